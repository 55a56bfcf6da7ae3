"""All the outbox's SQL is in ``outbox/sql/``, in its one style (the package's docstring).

Read from the source with ``ast``: a string literal that reads as SQL anywhere else in
``outbox/`` fails (the migrations aside: they are the schema's history), and so does SQL
built from strings inside the package. The identifiers written out in the statements (channel
names, the terminal states, the columns a driver statement names by position, the broker's
table) are checked against the Python constants they spell.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import TextClause, and_
from sqlalchemy.dialects.postgresql.base import PGDialect

from outbox import sql
from outbox.schema import operations
from outbox.sql.columns import OPERATION_COLUMNS
from outbox.states import TERMINAL_STATES

OUTBOX = Path(sql.__file__).resolve().parents[1]
SQL_PACKAGE = OUTBOX / "sql"

#: Files that may hold SQL text outside the package, each with why.
ALLOWED = {
    # The schema's history: each migration's DDL is frozen as it was applied.
    "migrations/",
    # Table definitions: server defaults and partial-index predicates are DDL fragments.
    "schema.py",
    # The reference service's own SQLite ledger: a fake remote's store, not the outbox's
    # database (its statements are still constants, checked below).
    "dev/service/ledger.py",
}

# Uppercase keywords in the shapes statements take, not the words of prose.
SQL = re.compile(
    r"\b(SELECT\s+(\*|\w|\(|%|\{)|INSERT\s+INTO|UPDATE\s+[\w.{}]+\s+(AS\s+\w+\s+)?SET|"
    r"DELETE\s+FROM|UNLISTEN\s+\*|LISTEN\s+(\{|[a-z_]+\s*(;|$))|NOTIFY\s+(\{|[a-z_]+\s*(,|;|$))|"
    r"pg_notify\(|TRUNCATE\s|"
    r"(CREATE|ALTER|DROP)\s+(TABLE|INDEX|SCHEMA|FUNCTION|TRIGGER|VIEW)|"
    r"SET\s+(LOCAL\s+|SESSION\s+)?\w+\s*(=|TO\s)|SET\s+TRANSACTION|WITH\s+\w+\s+AS\s+(MATERIALIZED\s+)?\()"
)

#: What may build a statement: outside the package (and the files above), none of these.
BUILDERS = {"text", "select", "insert", "update", "delete", "literal_column", "table"}


def _relative(path: Path) -> str:
    return path.relative_to(OUTBOX).as_posix()


def _allowed(path: Path) -> bool:
    name = _relative(path)
    return any(name == entry or name.startswith(entry) for entry in ALLOWED)


def _sources() -> Iterator[Path]:
    yield from sorted(OUTBOX.rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the constant nodes that are docstrings (prose, which may quote SQL)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _text_of(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's, each replacement field written ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text_of(part) or "{}" for part in node.values)
    return None


def _sql_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string literal of ``path`` that reads as SQL, docstrings aside."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = _docstrings(tree)
    return [
        (node.lineno, text.strip().splitlines()[0][:60])
        for node in ast.walk(tree)
        if isinstance(node, ast.expr)
        and id(node) not in prose
        and (text := _text_of(node)) is not None
        and SQL.search(text) is not None
    ]


def test_no_sql_text_outside_the_sql_package() -> None:
    offenders = [
        f"{_relative(path)}:{line}: {text!r}"
        for path in _sources()
        if not path.is_relative_to(SQL_PACKAGE) and not _allowed(path)
        for line, text in _sql_literals(path)
    ]
    assert offenders == [], "SQL outside outbox/sql/:\n" + "\n".join(offenders)


def test_no_statement_builder_outside_the_sql_package() -> None:
    """No module outside the package imports what builds a statement from SQLAlchemy."""
    offenders = []
    for path in _sources():
        if path.is_relative_to(SQL_PACKAGE) or _allowed(path):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
                names = {alias.name for alias in node.names} & BUILDERS
                if names:
                    offenders.append(f"{_relative(path)}:{node.lineno}: {sorted(names)}")
    assert offenders == [], "statements built outside outbox/sql/:\n" + "\n".join(offenders)


def _is_sql_string(node: ast.AST) -> bool:
    text = _text_of(node)
    if text is not None:
        return SQL.search(text) is not None
    if isinstance(node, ast.BinOp):
        return _is_sql_string(node.left) or _is_sql_string(node.right)
    return False


def _built_sql(path: Path) -> list[str]:
    """Where ``path`` builds SQL from strings: an f-string, ``+``, ``%`` or ``.format``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr) and _is_sql_string(node):
            found.append(f"{node.lineno}: f-string")
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Add | ast.Mod)
            and _is_sql_string(node)
        ):
            found.append(f"{node.lineno}: {type(node.op).__name__}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
            and _is_sql_string(node.func.value)
        ):
            found.append(f"{node.lineno}: .format")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "text"
            and not (len(node.args) == 1 and isinstance(node.args[0], ast.Constant | ast.Name))
        ):
            found.append(f"{node.lineno}: text() of an expression")
    return found


def test_no_sql_built_from_strings_in_the_sql_package() -> None:
    offenders = [
        f"{_relative(path)}:{where}"
        for path in sorted(SQL_PACKAGE.rglob("*.py"))
        for where in _built_sql(path)
    ]
    assert offenders == [], "SQL built from strings:\n" + "\n".join(offenders)


def test_the_reference_service_ledger_builds_no_sql_from_strings() -> None:
    """Allowed its own SQL (a fake remote's SQLite store), the ledger still writes it out."""
    ledger = OUTBOX / "dev" / "service" / "ledger.py"
    assert _allowed(ledger)
    assert _sql_literals(ledger), "the ledger's statements moved: update ALLOWED"
    assert _built_sql(ledger) == []


def test_every_text_statement_is_a_module_constant() -> None:
    """``text()`` only at module level: a statement is named once, never written in a call."""
    offenders = []
    for path in sorted(SQL_PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            offenders += [
                f"{_relative(path)}:{node.lineno}: text() in {function.name}()"
                for node in ast.walk(function)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "text"
            ]
    assert offenders == [], "statements written in calls:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "verdict"),
    [
        ('text(f"LISTEN {CHANNEL}")', True),
        ('"DELETE FROM " + table', True),
        ('"SELECT %s FROM t" % column', True),
        ('"UPDATE t SET a = {}".format(value)', True),
        ("text(statement)", False),
        ('text("SELECT 1 FROM t WHERE id = :id")', False),
        ('f"select the {thing} to update"', False),
        ('f"SELECT {columns} FROM t"', True),
        ('"Seconds between polls while idle (NOTIFY wakes sooner)."', False),
    ],
)
def test_the_check_tells_built_sql_from_constants(
    tmp_path: Path, source: str, verdict: bool
) -> None:
    module = tmp_path / "module.py"
    module.write_text(source + "\n", encoding="utf-8")
    assert bool(_built_sql(module)) is verdict


def _flat(statement: str) -> str:
    return " ".join(statement.split())


def test_each_listen_names_its_channel() -> None:
    notify = sql.notify
    assert _flat(notify._LISTEN_SETTLED.text) == f"LISTEN {notify.SETTLED_CHANNEL}"
    assert _flat(notify.LISTEN_BROKER) == f"LISTEN {notify.BROKER_CHANNEL}"
    assert _flat(notify.LISTEN_BROKER_AND_PLANNED) == (
        f"LISTEN {notify.BROKER_CHANNEL}; LISTEN {notify.PLANNED_CHANNEL}"
    )
    assert _flat(notify._LISTEN_PLANNED.text).endswith(f"LISTEN {notify.PLANNED_CHANNEL}")
    assert (
        _flat(notify._LISTEN_UNKNOWN_OPERATION.text) == f"LISTEN {notify.UNKNOWN_OPERATION_CHANNEL}"
    )
    assert _flat(notify._LISTEN_RELAY.text) == f"LISTEN {notify.RELAY_CHANNEL}"
    assert _flat(notify._LISTEN_PLANNED_ONLY.text) == f"LISTEN {notify.PLANNED_CHANNEL}"
    assert _flat(notify._UNLISTEN_PLANNED_ONLY.text) == f"UNLISTEN {notify.PLANNED_CHANNEL}"
    assert f"pg_notify('{notify.RELAY_CHANNEL}', :why)" in sql.relay._RING_RELAYS.text
    for rung in (
        sql.intents._INSERT_INTENT.sql,
        sql.intents._INSERT_INTENTS.text,
        sql.relay._RING_IF_DUE_UNPUBLISHED.text,
    ):
        assert f"pg_notify('{notify.PLANNED_CHANNEL}', '')" in rung


def test_retention_names_the_terminal_states() -> None:
    states = ", ".join(f"'{state.value}'" for state in sorted(TERMINAL_STATES))
    for statement in (sql.retention._PRUNE_BATCH, sql.retention._COUNT_PRUNABLE):
        assert f"o.state IN ({states})" in _flat(statement.text)


def test_the_locked_read_selects_the_operation_columns_in_order() -> None:
    columns = ", ".join(f"op.{name}" for name in OPERATION_COLUMNS)
    assert f"lk.synchronous_commit, {columns}, " in _flat(sql.locks._LOCK_AND_READ.sql)
    # The take that locks reads the row the same way (outbox.sql.relay).
    taken = "coalesce(lk.taken, false) AS taken, "
    assert f"{taken}{columns}, " in _flat(sql.relay._CLAIM_AND_MARK_DUE.sql)


def _tight(statement: str) -> str:
    """``statement`` flattened, without the spaces a line break leaves inside brackets."""
    return re.sub(r"([(\[]) | (?=[)\]])", r"\1", _flat(statement))


def test_the_take_that_sends_checks_the_dispatcher_s_send_terms_word_for_word() -> None:
    """The take's `sent` move (outbox.sql.relay, written out) holds the conditions of the
    dispatcher's move at the lock (outbox.sql.moves.send_conditions) exactly as SQLAlchemy
    renders them on ``outbox.operations AS o``: one definition, the other checked against it."""
    named = PGDialect(paramstyle="named")  # type: ignore[no-untyped-call]  # untyped upstream
    rendered = and_(*sql.moves.send_conditions(operations.alias("o"))).compile(dialect=named)
    take = sql.relay._CLAIM_AND_MARK_DUE.clause
    assert isinstance(take, TextClause)
    assert _tight(str(rendered)) in _tight(take.text)


def test_the_broker_statement_names_the_broker_table() -> None:
    from outbox.workers.app import BROKER_MESSAGE_TABLE  # noqa: PLC0415 -- needs [worker]

    assert f"DELETE FROM {BROKER_MESSAGE_TABLE} " in sql.broker._PRUNE_CONSUMED.text
    assert f"DELETE FROM {BROKER_MESSAGE_TABLE} " in _flat(sql.broker._TAKE_MESSAGE.text)
    assert f"INSERT INTO {BROKER_MESSAGE_TABLE} " in _flat(sql.broker._INSERT_MESSAGES.text)

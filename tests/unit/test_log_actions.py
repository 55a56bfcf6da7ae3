"""Every log action is a member of ``outbox.logs.Action``, in the code and in the tests.

The code is read with ``ast``: a log line's ``extra={"action": …}`` must name a member
(``Action.X``) or look one up in a module-level mapping whose values are all members, never a
string or an f-string (grepping an action's name must find the code that logs it).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.logs import Action

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE_NAMES = {"Action", "LogAction"}  # LogAction where a module has its own Action


def _modules() -> list[Path]:
    return sorted(p for p in (ROOT / "outbox").rglob("*.py") if "migrations" not in p.parts)


def _action_values(tree: ast.AST) -> Iterator[ast.expr]:
    """The value of every ``"action": …`` entry in a dict display."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "action":
                    yield value


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _members_named(value: ast.expr, path: Path) -> set[Action]:
    """The catalogue members a log line's action expression can produce."""
    if (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id in CATALOGUE_NAMES
    ):
        assert value.attr in Action.__members__, f"{path}:{value.lineno}: no Action.{value.attr}"
        return {Action[value.attr]}
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name):
        mapping = getattr(importlib.import_module(_module_name(path)), value.value.id)
        assert isinstance(mapping, dict), f"{path}:{value.lineno}: {value.value.id} is no dict"
        assert mapping, f"{path}:{value.lineno}: {value.value.id} is empty"
        for member in mapping.values():
            assert isinstance(member, Action), f"{path}:{value.lineno}: {member!r} not an Action"
        return set(mapping.values())
    pytest.fail(f"{path}:{value.lineno}: log action {ast.unparse(value)} is not an Action member")


def test_every_logged_action_is_in_the_catalogue_and_every_member_is_logged() -> None:
    """No literal or f-string action anywhere in outbox/; no member nobody logs."""
    used: set[Action] = set()
    for path in _modules():
        for value in _action_values(ast.parse(path.read_text(), str(path))):
            used |= _members_named(value, path)
    assert used, "the scan found no log action at all: is it reading the right files?"
    assert set(Action) - used == set(), "members of Action that no module logs"


def test_the_tests_name_actions_by_their_member() -> None:
    """A test that looks for an action in log records or output spells it ``Action.X``."""
    values = {member.value for member in Action}
    literal = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant) and node.value in values
    ]
    assert literal == []


def test_the_values_are_what_operators_grep_for() -> None:
    """Each member's value is its name in lower case, so the two never drift apart."""
    assert [m.value for m in Action] == [m.name.lower() for m in Action]

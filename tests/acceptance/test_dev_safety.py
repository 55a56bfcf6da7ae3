"""Destructive dev runs touch only what they created, or what their caller names.

``outbox dev scenario`` empties the outbox tables before it runs: pointed at a database it did
not create, it refuses (exit 2, one line) and leaves every row where it was, unless
``--i-own-this-database`` names that very database. ``outbox chaos`` restarts only a RabbitMQ
node it started itself: where it cannot start one, it refuses rather than take the machine's.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, make_url, text

from outbox import migrate
from outbox.db import create_engine
from outbox.dev.ownership import NotOwned
from outbox.dev.scenario import run_scenario
from tests.acceptance.conftest import Result, clean_environment, run_outbox
from tests.conftest import Databases
from tests.factories import make_operation

#: Trust authentication: any password connects; none may be printed.
PASSWORD = "not-the-real-one"  # noqa: S105 -- a dummy


def _with_password(url: str) -> str:
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


@pytest.fixture
def theirs(databases: Databases) -> Iterator[tuple[str, Engine]]:
    """A migrated database with three operations in it, which no command here created."""
    url = _with_password(databases.create())
    engine = create_engine(url)
    migrate.upgrade(engine)
    for i in range(3):
        make_operation(engine, intent_key=f"theirs-{i}")
    yield url, engine
    engine.dispose()


def _rows(engine: Engine) -> tuple[int, int]:
    """(operations, events) in the database."""
    with engine.connect() as conn:
        operations = conn.execute(text("SELECT count(*) FROM outbox.operations")).scalar_one()
        events = conn.execute(text("SELECT count(*) FROM outbox.events")).scalar_one()
    return int(operations), int(events)


def _scenario(tmp_path: Path, *args: str, url: str | None, timeout: float = 60) -> Result:
    env = clean_environment(OUTBOX_HOME=str(tmp_path / "home"))
    if url is not None:
        env["OUTBOX_DATABASE_URL"] = url
    return run_outbox("dev", "scenario", "--intents", "20", *args, env=env, timeout=timeout)


def _one_line_error(result: Result, *fragments: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.code == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert PASSWORD not in result.stderr
    assert result.stdout == ""
    return lines[0]


def test_scenario_refuses_a_database_it_did_not_create(
    theirs: tuple[str, Engine], tmp_path: Path
) -> None:
    """OUTBOX_DATABASE_URL set and no flag: exit 2, one line naming the flag, nothing emptied."""
    url, engine = theirs
    before = _rows(engine)

    result = _scenario(tmp_path, url=url)

    _one_line_error(result, "--i-own-this-database", make_url(url).database or "")
    assert before[0] == 3
    assert _rows(engine) == before


def test_scenario_refuses_a_flag_naming_another_database(
    theirs: tuple[str, Engine], databases: Databases, tmp_path: Path
) -> None:
    """The flag must name the database it would empty: another one is refused, nothing emptied."""
    url, engine = theirs
    before = _rows(engine)

    result = _scenario(tmp_path, "--i-own-this-database", databases.create(), url=url)

    _one_line_error(result, "--i-own-this-database names", "nobody named")
    assert _rows(engine) == before


def test_scenario_refuses_the_flag_without_a_database_url(tmp_path: Path) -> None:
    """The flag confirms OUTBOX_DATABASE_URL; without one it is a usage error."""
    result = _scenario(tmp_path, "--i-own-this-database", "postgresql://x@127.0.0.1/y", url=None)

    _one_line_error(result, "OUTBOX_DATABASE_URL is not set")


def test_run_scenario_refuses_before_touching_anything(theirs: tuple[str, Engine]) -> None:
    """The library refuses too: no ``i_own_this_database``, or another database, raises."""
    url, engine = theirs
    before = _rows(engine)
    other = make_url(url).set(database="postgres").render_as_string(hide_password=False)

    for named in (None, other):
        with pytest.raises(NotOwned):
            run_scenario(url, mode="lookup", intents=5, i_own_this_database=named)

    assert _rows(engine) == before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_flag_naming_the_database_lets_the_scenario_empty_it(
    theirs: tuple[str, Engine], tmp_path: Path
) -> None:
    """Named (as printed: password masked, any driver spelling), the database is emptied and
    the scenario runs on it."""
    url, engine = theirs
    named = make_url(url).set(drivername="postgresql").render_as_string(hide_password=True)

    result = _scenario(
        tmp_path, "--mode", "lookup", "--i-own-this-database", named, url=url, timeout=240
    )

    assert result.code == 0, result.stderr[-3000:] + result.stdout[-3000:]
    with engine.connect() as conn:
        keys = conn.execute(text("SELECT intent_key FROM outbox.operations")).scalars().all()
    assert len(keys) == 20
    assert not any(key.startswith("theirs-") for key in keys)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_a_database_url_the_scenario_runs_on_a_cluster_of_its_own(
    tmp_path: Path,
) -> None:
    """OUTBOX_DATABASE_URL unset: a throw-away cluster, not the embedded PostgreSQL."""
    result = _scenario(tmp_path, "--mode", "lookup", url=None, timeout=240)

    assert result.code == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "[lookup] 20 intents" in result.stdout
    assert not (tmp_path / "home").exists()  # the embedded server would live there


def test_chaos_refuses_rabbitmq_when_it_cannot_start_a_node_of_its_own(tmp_path: Path) -> None:
    """No rabbitmq-server on PATH: --broker rabbitmq is refused rather than restart the
    machine's node (exit 2, one line), before any cluster or process is started."""
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    if shutil.which("rabbitmq-server", path=path):
        pytest.skip("rabbitmq-server is installed outside /usr/sbin here")
    env = clean_environment(PATH=path)

    result = run_outbox(
        "chaos", "--broker", "rabbitmq", "--workdir", str(tmp_path / "chaos"), env=env
    )

    _one_line_error(result, "--i-own-this-rabbitmq-node", "rabbitmq-server")
    assert not (tmp_path / "chaos").exists()

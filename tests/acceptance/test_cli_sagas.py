"""``outbox sagas list|show|cancel``, run as a real subprocess against a real PostgreSQL; the
sagas are built with the Python API and the driver's own functions (no worker)."""

from __future__ import annotations

from sqlalchemy import Engine

from outbox.sagas import SagaState
from outbox.states import State
from tests.acceptance.conftest import CLI
from tests.factories import reload
from tests.integration.test_sagas import THREE, advance, finish, open_saga, state_of, view


def compensated_saga(engine: Engine, key: str) -> None:
    """A saga whose third step was refused and whose first two steps were undone."""
    release, point, announce = open_saga(engine, key, THREE, requested_by="agent-7")
    finish(engine, release.id, State.CONFIRMED, remote_ref="rel-42")
    advance(engine, key)
    finish(engine, point.id, State.CONFIRMED, remote_ref="lb-change-7")
    advance(engine, key)
    finish(engine, announce.id, State.FAILED)
    advance(engine, key)
    for _ in range(2):
        undo = next(
            s.compensation_operation_id
            for s in view(engine, key).steps
            if s.compensation_operation_id is not None and s.compensation_state is State.PLANNED
        )
        finish(engine, undo, State.CONFIRMED)
        advance(engine, key)
    assert state_of(engine, key) is SagaState.COMPENSATED


def test_list_and_show_a_compensated_saga(engine: Engine, outbox_cli: CLI) -> None:
    """`sagas list` shows the saga with its state; `show` its steps in order, their
    compensations and the audit trail, as a table and in --json."""
    compensated_saga(engine, "s-cli")
    open_saga(engine, "s-cli-running", THREE[:1])
    listed = outbox_cli("sagas", "list", "--json")
    assert listed.code == 0, listed
    assert [(s["key"], s["state"], s["steps"]) for s in listed.json()] == [
        ("s-cli-running", "running", 1),
        ("s-cli", "compensated", 3),
    ]
    only = outbox_cli("sagas", "list", "--state", "compensated", "--json")
    assert [s["key"] for s in only.json()] == ["s-cli"]
    table = outbox_cli("sagas", "list")
    assert table.code == 0, table
    assert "s-cli-running" in table.stdout
    assert "compensated" in table.stdout
    shown = outbox_cli("sagas", "show", "s-cli", "--json")
    assert shown.code == 0, shown
    body = shown.json()
    assert (body["key"], body["state"], body["requested_by"]) == ("s-cli", "compensated", "agent-7")
    assert [
        (s["position"], s["name"], s["state"], s["remote_ref"], s["compensation_state"])
        for s in body["steps"]
    ] == [
        (0, "release", "confirmed", "rel-42", "confirmed"),
        (1, "point-lb", "confirmed", "lb-change-7", "confirmed"),
        (2, "announce", "failed", None, None),
    ]
    assert body["steps"][1]["compensate"]["tool"] == "lb.point"
    assert body["events"][-1]["to_state"] == "compensated"
    text = outbox_cli("sagas", "show", "s-cli")
    assert text.code == 0, text
    for expected in ("compensated", "point-lb", "lb-change-7", "deploy.delete_release", "events"):
        assert expected in text.stdout


def test_show_names_the_operation_a_needs_human_saga_waits_for(
    engine: Engine, outbox_cli: CLI
) -> None:
    """A saga held by a compensation in needs_human: `show` names that operation to resolve."""
    release, point, _ = open_saga(engine, "s-cli-human", THREE)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-cli-human")
    finish(engine, point.id, State.FAILED)
    advance(engine, "s-cli-human")
    undo = view(engine, "s-cli-human").steps[0].compensation_operation_id
    assert undo is not None
    finish(engine, undo, State.NEEDS_HUMAN)
    assert advance(engine, "s-cli-human") is SagaState.NEEDS_HUMAN
    shown = outbox_cli("sagas", "show", "s-cli-human")
    assert shown.code == 0, shown
    assert "waiting for a person" in shown.stdout
    assert f"outbox ops show {undo}" in shown.stdout
    op = outbox_cli("ops", "show", str(undo))
    assert "s-cli-human (the undo of step release; outbox sagas show s-cli-human)" in op.stdout
    listed = outbox_cli("sagas", "list", "--state", "needs_human")
    assert "s-cli-human" in listed.stdout


def test_an_unknown_key_is_one_line_and_exit_1(outbox_cli: CLI) -> None:
    """`sagas show` of a key no saga has prints one error line and exits 1."""
    result = outbox_cli("sagas", "show", "no-such-saga")
    assert result.code == 1, result
    assert result.stderr.strip().splitlines() == ["error: no saga 'no-such-saga'"]
    cancelled = outbox_cli("sagas", "cancel", "no-such-saga", "--by", "ada", "--reason", "x")
    assert cancelled.code == 1, cancelled
    assert len(cancelled.stderr.strip().splitlines()) == 1


def test_a_bad_state_is_a_usage_error(outbox_cli: CLI) -> None:
    """`sagas list --state done` is a usage error naming the option: one line, exit 2."""
    result = outbox_cli("sagas", "list", "--state", "done")
    assert result.code == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert "--state" in line
    assert "needs_human" in line


def test_cancel_a_running_saga_as_an_operator(engine: Engine, outbox_cli: CLI) -> None:
    """`sagas cancel` cancels a running saga's unsent steps, records the operator, and
    refuses a second cancel with one line."""
    ops = open_saga(engine, "s-cli-cancel", THREE)
    done = outbox_cli(
        "sagas", "cancel", "s-cli-cancel", "--by", "ada", "--reason", "wrong version", "--json"
    )
    assert done.code == 0, done
    body = done.json()
    assert (body["state"], body["cancelled_by"]) == ("cancelled", "ada")
    assert [reload(engine, op.id).state for op in ops] == [State.CANCELLED] * 3
    moved = [e for e in body["events"] if e["from_state"] == "running"]
    assert [(e["actor"], e["detail"]) for e in moved] == [
        ("operator", {"by": "ada", "reason": "wrong version"})
    ]
    again = outbox_cli("sagas", "cancel", "s-cli-cancel", "--by", "ada", "--reason", "again")
    assert again.code == 1, again
    (line,) = again.stderr.strip().splitlines()
    assert "only a running saga can be cancelled" in line
    empty = outbox_cli("sagas", "cancel", "s-cli-cancel", "--by", " ", "--reason", "x")
    assert empty.code == 2, empty


def test_show_says_a_refused_undo_is_left_to_a_person(engine: Engine, outbox_cli: CLI) -> None:
    """A saga whose undo was refused is needs_human, and `show` says to undo that step by hand."""
    release, point, _ = open_saga(engine, "s-cli-refused-undo", THREE)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-cli-refused-undo")
    finish(engine, point.id, State.FAILED)
    advance(engine, "s-cli-refused-undo")
    undo = view(engine, "s-cli-refused-undo").steps[0].compensation_operation_id
    assert undo is not None
    finish(engine, undo, State.FAILED)
    assert advance(engine, "s-cli-refused-undo") is SagaState.NEEDS_HUMAN
    shown = outbox_cli("sagas", "show", "s-cli-refused-undo")
    assert shown.code == 0, shown
    assert "the undo of step release was refused: undo it by hand" in shown.stdout
    listed = outbox_cli("sagas", "list", "--state", "needs_human", "--json")
    assert [(s["key"], s["state"]) for s in listed.json()] == [
        ("s-cli-refused-undo", "needs_human")
    ]


def test_help_explains_every_saga_state_and_what_to_do_about_needs_human(
    outbox_cli: CLI,
) -> None:
    """`outbox sagas --help` names every saga state and tells an operator how to handle
    needs_human."""
    result = outbox_cli("sagas", "--help")
    assert result.code == 0, result
    text = " ".join(result.stdout.replace("│", " ").split())
    for state in SagaState:
        assert f"{state.value}:" in text
    assert "outbox ops resolve" in text
    assert "undo by hand" in text

"""``outbox tools publish|list``: the configured tools' contracts published without a worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

import outbox
from outbox.contracts import CONTRACTS
from outbox.errors import InvalidIntent, PayloadInvalid
from outbox.published import PUBLISHED
from tests.acceptance.conftest import run_outbox
from tests.factories import operation_count
from tests.tool_configs import TOOL, http_tool_toml

SCHEMA_TOML = f"""
[tools."{TOOL}".input_schema]
type = "object"
required = ["version"]
properties = {{ version = {{ type = "string" }} }}
"""


def test_publish_makes_enqueue_check_the_tools_without_a_worker(
    cli_env: dict[str, str], engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Published from OUTBOX_CONFIG, the tool is listed with its schema, and enqueue in a
    process that loads no tools refuses another tool and a payload the schema refuses."""
    config = tmp_path / "tools.toml"
    config.write_text(http_tool_toml("http://127.0.0.1:9") + SCHEMA_TOML, encoding="utf-8")
    env = {**cli_env, "OUTBOX_CONFIG": str(config)}
    published = run_outbox("tools", "publish", "--json", env=env)
    assert published.code == 0, published.stderr
    assert published.json() == {"tools": [TOOL], "budgets": 0}
    again = run_outbox("tools", "publish", env=env)  # unchanged rows are left alone
    assert (again.code, again.stdout.strip()) == (0, f"published 1 tool(s): {TOOL}; 0 budget(s)")
    listed = run_outbox("tools", "list", "--json", env=cli_env).json()["tools"]
    assert [(t["tool"], t["input_schema"]["required"]) for t in listed] == [(TOOL, ["version"])]

    monkeypatch.setattr(CONTRACTS, "loaded", False)
    PUBLISHED.clear()
    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidIntent) as unknown:
            outbox.enqueue(session, tool="deploy.create_relase", target="web", payload={})
        with pytest.raises(PayloadInvalid) as refused:
            outbox.enqueue(session, tool=TOOL, target="web", payload={"version": 2})
        outbox.enqueue(session, tool=TOOL, target="web", payload={"version": "2"})
    assert (unknown.value.field, refused.value.field) == ("tool", "payload.version")
    assert operation_count(engine) == 1


def test_publish_with_no_tools_configured_fails_in_one_line(cli_env: dict[str, str]) -> None:
    """Nothing configured, there is nothing to publish: one line naming the variables, exit 1."""
    result = run_outbox("tools", "publish", env=cli_env)
    assert result.code == 1
    assert result.stderr.strip().splitlines() == [
        "error: no tools are configured: set OUTBOX_CONFIG (a TOML file) or OUTBOX_TOOLS (modules)"
    ]

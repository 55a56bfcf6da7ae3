"""A tool's declared payload schema (outbox.payloads): checked when declared, then per payload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from outbox.contracts import ToolContract
from outbox.errors import ConfigError, PayloadInvalid
from outbox.payloads import check_payload, schema_problem
from outbox.tools import Applied, ToolCall, tool
from outbox.tools.http import load_http_tools
from outbox.tools.registry import ToolRegistry

CHARGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "amount": {"type": "integer", "minimum": 1},
        "currency": {"enum": ["EUR", "USD"]},
        "items": {
            "type": "array",
            "items": {"type": "object", "required": ["sku"], "properties": {"sku": {}}},
        },
        "card": {"type": "string", "pattern": "^tok_"},
    },
    "required": ["amount", "currency"],
    "additionalProperties": False,
}


def refusal(payload: dict[str, Any]) -> PayloadInvalid:
    with pytest.raises(PayloadInvalid) as caught:
        check_payload("billing.charge", CHARGE, payload)
    return caught.value


def test_a_matching_payload_passes() -> None:
    """A payload that matches the schema raises nothing."""
    check_payload("billing.charge", CHARGE, {"amount": 5, "currency": "EUR", "items": [{"sku": 1}]})


@pytest.mark.parametrize(
    ("payload", "field", "keyword"),
    [
        ({"currency": "EUR"}, "payload.amount", "required"),
        ({"amount": "5", "currency": "EUR"}, "payload.amount", "type"),
        ({"amount": 0, "currency": "EUR"}, "payload.amount", "minimum"),
        ({"amount": 5, "currency": "GBP"}, "payload.currency", "enum"),
        (
            {"amount": 5, "currency": "EUR", "items": [{"sku": 1}, {}]},
            "payload.items[1].sku",
            "required",
        ),
        ({"amount": 5, "currency": "EUR", "extra": 1}, "payload", "additionalProperties"),
    ],
)
def test_a_mismatch_names_the_path_and_the_keyword(
    payload: dict[str, Any], field: str, keyword: str
) -> None:
    """The refusal names the path and the keyword it fails, and says nothing was written."""
    error = refusal(payload)
    assert (error.field, error.keyword) == (field, keyword)
    assert "tool 'billing.charge'" in str(error)
    assert field in str(error)
    assert "nothing was written" in str(error)


def test_a_refusal_never_quotes_the_payloads_values() -> None:
    """What the payload held (a card number here) is not in the message; the schema's rule is."""
    error = refusal({"amount": 5, "currency": "EUR", "card": "4242424242424242"})
    assert error.field == "payload.card"
    assert "4242" not in str(error)
    assert "^tok_" in str(error)


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "nope"}, "not a valid JSON Schema"),
        (["type", "object"], "must be a table"),
        ({"$ref": "https://example.com/charge.json"}, "only references inside the schema"),
        ({"properties": {"a": {"$ref": "other.json#/x"}}}, "'other.json#/x'"),
    ],
)
def test_a_broken_schema_is_named(schema: object, problem: str) -> None:
    """An invalid schema, a non-table or a reference outside the schema is refused with why."""
    found = schema_problem(schema)
    assert found is not None
    assert problem in found


def test_local_references_and_a_named_dialect_are_accepted() -> None:
    """'#/...' references resolve and a schema's own $schema dialect is honoured."""
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"positive": {"type": "integer", "exclusiveMinimum": 0}},
        "properties": {"n": {"$ref": "#/definitions/positive"}},
    }
    assert schema_problem(schema) is None
    check_payload("t", schema, {"n": 1})
    with pytest.raises(PayloadInvalid, match=r"payload\.n fails exclusiveMinimum: 0"):
        check_payload("t", schema, {"n": 0})


def test_a_contract_with_a_broken_schema_is_refused_naming_the_tool() -> None:
    """Building a contract checks its schema: ConfigError names the tool."""
    with pytest.raises(ConfigError, match=r"tool 'billing.charge': input_schema is not a valid"):
        ToolContract(name="billing.charge", input_schema={"type": 5})


def test_the_decorator_and_the_toml_declare_a_schema_and_a_description(tmp_path: Path) -> None:
    """@tool(input_schema=, description= or a docstring) and TOML keys land in the contract."""
    registry = ToolRegistry()

    @tool("billing.charge", input_schema=CHARGE, registry=registry)
    def charge(call: ToolCall) -> Applied:
        raise AssertionError("never called")

    assert charge.contract.input_schema == CHARGE
    assert charge.contract.description is None  # no docstring, no description

    @tool("billing.refund", registry=registry)
    def refund(call: ToolCall) -> Applied:
        """Refund a charge.

        Only the whole amount."""
        raise AssertionError("never called")

    @tool("billing.void", description="Void an authorisation.", registry=registry)
    def void(call: ToolCall) -> Applied:
        """Not what models read."""
        raise AssertionError("never called")

    assert refund.contract.description == "Refund a charge.\n\nOnly the whole amount."
    assert void.contract.description == "Void an authorisation."
    path = tmp_path / "tools.toml"
    path.write_text(
        """
[tools."deploy.create_release"]
kind = "http"
url = "http://127.0.0.1:8900/projects/{target}/releases"
idempotency_header = "Idempotency-Key"
remote_ref = "id"
description = "Create a release of a project."
[tools."deploy.create_release".input_schema]
type = "object"
required = ["version"]
properties = { version = { type = "string" } }
""",
        encoding="utf-8",
    )
    (http_tool,) = load_http_tools(path)
    assert http_tool.contract.description == "Create a release of a project."
    assert http_tool.contract.input_schema == {
        "type": "object",
        "required": ["version"],
        "properties": {"version": {"type": "string"}},
    }


def test_a_toml_schema_that_is_broken_names_the_file_and_the_tool(tmp_path: Path) -> None:
    """A broken TOML input_schema is refused at load, naming OUTBOX_CONFIG and the tool."""
    path = tmp_path / "tools.toml"
    path.write_text(
        """
[tools."deploy.create_release"]
kind = "http"
url = "http://127.0.0.1:8900/projects/{target}/releases"
idempotency_header = "Idempotency-Key"
remote_ref = "id"
input_schema = { type = "strin" }
""",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"OUTBOX_CONFIG.*deploy.create_release.*input_schema"):
        load_http_tools(path)


#: A schema whose ``ref`` must be a release id, chosen from a few kinds, with a bounded note.
UNRESOLVED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["ref"],
    "additionalProperties": False,
    "properties": {
        "ref": {"type": "string", "pattern": "^rel-"},
        "kind": {"enum": ["release", "hotfix"]},
        "refs": {"type": "array", "items": {"type": "string", "pattern": "^[0-9a-f-]{36}$"}},
        "note": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
    },
}


@pytest.mark.parametrize(
    "payload",
    [
        {"ref": "{remote_ref}"},
        {"ref": "{remote_ref}", "kind": "{remote_ref}"},
        {"ref": "rel-1", "refs": ["{remote_ref}"]},
        {"ref": "rel-1", "note": "was {remote_ref}"},
    ],
)
def test_a_value_waiting_for_its_substitution_is_not_judged_yet(payload: dict[str, Any]) -> None:
    check_payload("t", UNRESOLVED_SCHEMA, payload, unresolved="{remote_ref}")
    with pytest.raises(PayloadInvalid):  # without the marker, the same payload fails
        check_payload("t", UNRESOLVED_SCHEMA, payload)


@pytest.mark.parametrize(
    ("payload", "field", "keyword"),
    [
        ({"kind": "{remote_ref}"}, "payload.ref", "required"),
        ({"ref": "{remote_ref}", "extra": 1}, "payload", "additionalProperties"),
        ({"ref": ["{remote_ref}"]}, "payload.ref", "type"),
        ({"ref": "{remote_ref}", "kind": "major"}, "payload.kind", "enum"),
    ],
)
def test_what_no_substitution_can_mend_is_refused_at_once(
    payload: dict[str, Any], field: str, keyword: str
) -> None:
    with pytest.raises(PayloadInvalid) as caught:
        check_payload("t", UNRESOLVED_SCHEMA, payload, unresolved="{remote_ref}")
    assert (caught.value.field, caught.value.keyword) == (field, keyword)

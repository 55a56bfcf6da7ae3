"""Tool registration: the decorator, the registry, TOML HTTP tools and ``load_tools``."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from outbox import api
from outbox.config import Settings, load_settings
from outbox.contracts import CONTRACTS, ContractTable, ToolContract
from outbox.errors import ConfigError, InvalidIntent
from outbox.tools import (
    REGISTRY,
    Applied,
    Dedup,
    DispatchResult,
    HttpTool,
    Inconclusive,
    LookupResult,
    NotApplied,
    PythonTool,
    Tool,
    ToolCall,
    ToolRegistry,
    load_http_tools,
    load_tools,
    tool,
)
from outbox.tools.http.tool import render_url, resolve_ref

NAME = "deploy.create_release"

VALID_TOML = """
[tools."deploy.create_release"]
kind = "http"
method = "POST"
url = "http://127.0.0.1:8900/projects/{target}/releases"
idempotency_header = "Idempotency-Key"
timeout_s = 10
send_deadline_s = 2
remote_ref = "id"
rejected_statuses = [400, 403, 404, 422]
lookup_url = "http://127.0.0.1:8900/projects/{target}/releases/by-key/{operation_id}"
lookup_remote_ref = "id"
lookup_not_applied_statuses = [404]
inflight_horizon_s = 600
max_checks = 12
max_attempts = 5
dedup_window_s = 86400
dedup_margin_s = 300
dedup_concurrent_safe = false
headers = { X-Client = "s3cret-static" }
env_headers = { Authorization = "DEPLOY_TOKEN" }
"""

MINIMAL_TABLE = """
[tools."deploy.create_release"]
kind = "http"
url = "http://127.0.0.1:8900/projects/{target}/releases"
idempotency_header = "Idempotency-Key"
remote_ref = "id"
"""


@pytest.fixture(autouse=True)
def clean_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with empty tool tables and no ``OUTBOX_*`` variable, and leaves none."""
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    REGISTRY.clear()
    CONTRACTS.clear()
    yield
    REGISTRY.clear()
    CONTRACTS.clear()


@pytest.fixture
def write_toml(tmp_path: Path) -> Callable[[str], Path]:
    """Writes a TOML file and returns its path."""

    def write(text: str) -> Path:
        path = tmp_path / f"tools-{uuid.uuid4().hex[:8]}.toml"
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def tools_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Writes an importable module with the given source and returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(source: str) -> str:
        name = f"outbox_test_tools_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def make_call(**overrides: Any) -> ToolCall:
    """A ToolCall with plausible values."""
    values: dict[str, Any] = {
        "operation_id": "5d0c3f8e-0000-4000-8000-000000000001",
        "intent_key": "release-1.2.3",
        "tool": NAME,
        "target": "project-a",
        "payload": {"version": "1.2.3"},
        "attempt": 1,
        "timeout_s": 5.0,
    }
    return ToolCall(**(values | overrides))


def with_line(table: str, line: str) -> str:
    """``table`` with ``line`` added, or replacing the line that sets the same key."""
    key = line.split("=", 1)[0].strip()
    kept = [old for old in table.splitlines() if old.split("=", 1)[0].strip() != key]
    return "\n".join([*kept, line]) + "\n"


def settings(**overrides: Any) -> Settings:
    """Settings with the given overrides and nothing from the environment."""
    return load_settings(**overrides)


# --- the decorator ---------------------------------------------------------------------------


def test_decorator_registers_the_tool_and_its_contract() -> None:
    """@tool registers a PythonTool in REGISTRY and its contract in CONTRACTS, as declared."""

    @tool(
        "billing.charge",
        timeout=10,
        send_deadline=2,
        inflight_horizon=600,
        max_checks=12,
        max_attempts=5,
        dedup=Dedup(window_s=86400, margin_s=300, concurrent_safe=False),
    )
    def charge(call: ToolCall) -> DispatchResult:
        return Applied(f"ch_{call.operation_id}")

    assert isinstance(charge, PythonTool)
    assert REGISTRY.get("billing.charge") is charge
    assert "billing.charge" in REGISTRY
    assert CONTRACTS.get("billing.charge") == ToolContract(
        name="billing.charge",
        timeout_s=10,
        send_deadline_s=2,
        inflight_horizon_s=600,
        max_checks=12,
        max_attempts=5,
        dedup=Dedup(window_s=86400, margin_s=300, concurrent_safe=False),
    )
    assert charge.contract.has_lookup is False
    call = make_call(tool="billing.charge")
    assert charge.dispatch(call) == Applied(f"ch_{call.operation_id}")
    assert charge(call) == Applied(f"ch_{call.operation_id}")


def test_attaching_a_lookup_registers_has_lookup() -> None:
    """@charge.lookup attaches the lookup, keeps the function, and re-registers has_lookup."""

    @tool("billing.charge")
    def charge(call: ToolCall) -> DispatchResult:
        return Applied("ch_1")

    @charge.lookup
    def find_charge(call: ToolCall) -> LookupResult:
        return NotApplied()

    contract = CONTRACTS.get("billing.charge")
    assert contract is not None
    assert contract.has_lookup is True
    assert charge.contract.has_lookup is True
    assert find_charge(make_call()) == NotApplied()
    assert charge.lookup(make_call()) == NotApplied()
    assert not charge.is_async_dispatch
    assert not charge.is_async_lookup


def test_async_functions_are_recognised() -> None:
    """Async functions and async callable objects are flagged async, to run on an event loop."""

    @tool("billing.refund")
    async def refund(call: ToolCall) -> DispatchResult:
        return Applied("re_1")

    @refund.lookup
    async def find_refund(call: ToolCall) -> LookupResult:
        return Inconclusive("not yet")

    class Voider:
        async def __call__(self, call: ToolCall) -> DispatchResult:
            return Applied("vo_1")

    assert refund.is_async_dispatch
    assert refund.is_async_lookup
    assert tool("billing.void")(Voider()).is_async_dispatch


def test_a_second_lookup_is_refused() -> None:
    """A tool takes one lookup; attaching another raises ConfigError naming the tool."""

    @tool("billing.charge")
    def charge(call: ToolCall) -> DispatchResult:
        return Applied("ch_1")

    @charge.lookup
    def find_charge(call: ToolCall) -> LookupResult:
        return NotApplied()

    def find_charge_again(call: ToolCall) -> LookupResult:
        return NotApplied()

    with pytest.raises(ConfigError, match=r"'billing\.charge' already has a lookup"):
        charge.lookup(find_charge_again)


@pytest.mark.parametrize(
    ("knobs", "field"),
    [
        ({"timeout": 0}, "timeout_s must be positive"),
        ({"send_deadline": -1}, "send_deadline_s must be positive"),
        ({"max_attempts": 0}, "max_attempts must be positive"),
        ({"max_checks": 0}, "max_checks must be positive"),
        ({"timeout": 30, "inflight_horizon": 20}, "inflight_horizon_s (20) must be at least"),
        ({"dedup": Dedup(window_s=100, margin_s=300)}, "dedup window_s (100) must exceed"),
        ({"dedup": Dedup(window_s=100, margin_s=-1)}, "margin_s must not be negative"),
        (
            {"dedup": Dedup(window_s=86400, margin_s=0)},
            "dedup margin_s (0) must be at least send_deadline_s (2) + timeout_s (10) + 30s "
            "clock-skew allowance (42)",
        ),
        (
            {"timeout": 60, "inflight_horizon": 600, "dedup": Dedup(window_s=86400, margin_s=60)},
            "dedup margin_s (60) must be at least send_deadline_s (2) + timeout_s (60)",
        ),
    ],
)
def test_contradictory_values_are_refused_at_decoration(knobs: dict[str, Any], field: str) -> None:
    """Contradictory contract values raise ConfigError naming the tool and field; nothing is
    registered."""
    with pytest.raises(ConfigError, match=r"tool 'billing\.charge'") as error:

        @tool("billing.charge", **knobs)
        def charge(call: ToolCall) -> DispatchResult:
            return Applied("ch_1")

    assert field in str(error.value)
    assert "billing.charge" not in REGISTRY
    assert CONTRACTS.get("billing.charge") is None


@pytest.mark.parametrize("name", ["", "billing..charge", "9lives", "billing charge", "x" * 129])
def test_invalid_tool_names_are_refused(name: str) -> None:
    """A name enqueue would refuse is refused at decoration time."""
    with pytest.raises(ConfigError, match="tool name"):
        tool(name)


def test_duplicate_names_from_different_definitions_are_refused() -> None:
    """Two functions claiming one tool name raise ConfigError naming the tool and both."""

    @tool("billing.charge")
    def charge(call: ToolCall) -> DispatchResult:
        return Applied("ch_1")

    with pytest.raises(ConfigError, match=r"tool 'billing\.charge' is defined twice") as error:

        @tool("billing.charge")
        def charge_again(call: ToolCall) -> DispatchResult:
            return Applied("ch_2")

    assert "charge_again" in str(error.value)
    assert REGISTRY.get("billing.charge") is charge


def test_registering_the_same_definition_again_is_harmless() -> None:
    """Registering one tool twice (a module imported again) replaces it without an error."""

    @tool("billing.charge")
    def charge(call: ToolCall) -> DispatchResult:
        return Applied("ch_1")

    REGISTRY.register(charge)
    assert REGISTRY.names() == ["billing.charge"]


def test_a_registry_keeps_its_own_contract_table() -> None:
    """A registry built on another ContractTable registers there, not in CONTRACTS."""
    table = ContractTable()
    registry = ToolRegistry(table)

    @tool("billing.charge", registry=registry)
    def charge(call: ToolCall) -> DispatchResult:
        return Applied("ch_1")

    assert registry.names() == ["billing.charge"]
    assert len(registry) == 1
    assert table.names() == ["billing.charge"]
    assert CONTRACTS.names() == []
    assert "billing.charge" not in REGISTRY
    registry.clear()
    assert "billing.charge" not in registry


# --- HTTP tools from TOML --------------------------------------------------------------------


def test_toml_declares_an_http_tool(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DESIGN.md table loads into an HttpTool whose contract carries every knob."""
    monkeypatch.setenv("DEPLOY_TOKEN", "Bearer s3cret-env")
    (http_tool,) = load_http_tools(write_toml(VALID_TOML))
    assert isinstance(http_tool, HttpTool)
    assert http_tool.contract == ToolContract(
        name=NAME,
        timeout_s=10,
        send_deadline_s=2,
        inflight_horizon_s=600,
        max_checks=12,
        max_attempts=5,
        has_lookup=True,
        dedup=Dedup(window_s=86400, margin_s=300, concurrent_safe=False),
    )
    assert http_tool.is_async_dispatch
    assert http_tool.is_async_lookup
    assert "s3cret" not in repr(http_tool)


def test_toml_declares_an_approval(write_toml: Callable[[str], Path]) -> None:
    """approval = "required" and approval_ttl_s reach the tool's contract."""
    table = with_line(MINIMAL_TABLE, 'approval = "required"\napproval_ttl_s = 3600')
    (http_tool,) = load_http_tools(write_toml(table))
    assert http_tool.contract == ToolContract(
        name=NAME, approval_required=True, approval_ttl_s=3600
    )


def test_the_decorator_declares_an_approval() -> None:
    """@tool(approval="required", approval_ttl_s=...) sets the contract; another value is
    refused naming the tool and the field."""
    registry = ToolRegistry(ContractTable())

    @tool("billing.charge", approval="required", approval_ttl_s=60, registry=registry)
    def charge(call: ToolCall) -> DispatchResult:
        return Applied("ch_1")

    assert (charge.contract.approval_required, charge.contract.approval_ttl_s) == (True, 60)
    with pytest.raises(ConfigError, match=r"tool 'billing\.refund': approval must be one of"):
        tool("billing.refund", approval="yes", registry=registry)


def test_toml_defaults_come_from_the_contract(write_toml: Callable[[str], Path]) -> None:
    """A minimal table gets ToolContract's defaults, no lookup and no dedup contract."""
    (http_tool,) = load_http_tools(write_toml(MINIMAL_TABLE))
    assert http_tool.contract == ToolContract(name=NAME)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("bogus = 1", f'tools."{NAME}".bogus: unknown key; allowed keys: kind, method'),
        ("rejected_statuses = [422, 409]", "409 is never an authoritative refusal"),
        ("rejected_statuses = [503]", "only 4xx statuses are allowed here, not [503]"),
        ("rejected_statuses = [999]", f'tools."{NAME}".rejected_statuses[0]'),
        ('method = "GET"', f'tools."{NAME}".method: must be one of POST, PUT, PATCH, DELETE'),
        ("timeout_s = 0", "timeout_s must be positive"),
        ('timeout_s = "10"', f'tools."{NAME}".timeout_s: Input should be a valid number'),
        ("inflight_horizon_s = 10", "inflight_horizon_s (10) must be at least"),
        ('lookup_url = "http://h/{operation_id}"', "lookup_remote_ref is required"),
        ('lookup_remote_ref = "id"', "lookup_remote_ref has no effect without lookup_url"),
        ("dedup_margin_s = 10", "dedup_margin_s has no effect without dedup_window_s"),
        ("dedup_window_s = 100", "dedup window_s (100) must exceed its margin_s (300)"),
        (
            "dedup_window_s = 3600\ndedup_margin_s = 0",
            f'tools."{NAME}": dedup margin_s (0) must be at least send_deadline_s (2) + '
            "timeout_s (10) + 30s clock-skew allowance (42)",
        ),
        ('headers = { "Bad Name" = "v" }', "'Bad Name' is not an HTTP header name"),
        ('headers = { idempotency-key = "v" }', "set more than once"),
        ('remote_ref = "data..id"', "is not a dotted path"),
        ("max_attempts = true", f'tools."{NAME}".max_attempts: Input should be a valid integer'),
        ('approval = "maybe"', f"tools.\"{NAME}\".approval: Input should be 'none' or 'required'"),
        ("approval_ttl_s = 0", "approval_ttl_s must be positive"),
    ],
)
def test_invalid_tables_are_refused_naming_the_key(
    write_toml: Callable[[str], Path], extra: str, message: str
) -> None:
    """A bad value raises ConfigError naming OUTBOX_CONFIG, the file and the tool's key."""
    path = write_toml(with_line(MINIMAL_TABLE, extra))
    with pytest.raises(ConfigError) as error:
        load_http_tools(path)
    text = str(error.value)
    assert text.startswith(f"OUTBOX_CONFIG {path}: ")
    assert message in text


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h/projects/{project}/releases", "unknown placeholder {project}"),
        ("http://h/projects/{target!r}", "unknown placeholder {target}"),
        ("http://h/projects/{}", "unknown placeholder {}"),
        ("http://h/projects/{target", "unbalanced braces"),
        ("ftp://h/projects/{target}", "is not an http:// or https:// URL"),
        ("http://user:pw@h/projects/{target}", "credentials do not belong in the URL"),
        ("http://h/my projects/{target}", "use 'http://h/my%20projects/x'"),
        ("http://h/a/../projects/{target}", "no '.' or '..' segments"),
        ("http://h:{target}/projects", "has a placeholder in its port; write it out"),
        ("{target}://h/projects", "has a placeholder in its scheme; write it out"),
    ],
)
def test_bad_urls_are_refused_at_load(
    write_toml: Callable[[str], Path], url: str, message: str
) -> None:
    """A URL with an unknown placeholder or no http(s) host raises ConfigError naming url."""
    table = MINIMAL_TABLE.replace("http://127.0.0.1:8900/projects/{target}/releases", url)
    with pytest.raises(ConfigError, match=f'tools."{NAME}".url: ') as error:
        load_http_tools(write_toml(table))
    assert message in str(error.value)
    assert "pw" not in str(error.value)


@pytest.mark.parametrize(
    ("key", "template"),
    [
        ("url", "http://{target}/releases"),
        ("url", "http://{target}.example.com:8443/releases"),
        ("lookup_url", "https://{target}/by-key/{operation_id}"),
    ],
)
def test_a_placeholder_in_the_host_needs_allowed_hosts(
    write_toml: Callable[[str], Path], key: str, template: str
) -> None:
    """A host the agent's values choose is refused at load, naming the tool and the key,
    unless the tool declares allowed_hosts."""
    lookup = 'lookup_remote_ref = "id"\nlookup_not_applied_statuses = [404]'
    table = with_line(MINIMAL_TABLE, f'{key} = "{template}"')
    if key == "lookup_url":
        table += lookup + "\n"
    with pytest.raises(ConfigError) as error:
        load_http_tools(write_toml(table))
    assert f'tools."{NAME}": {key}: a placeholder in the host' in str(error.value)
    assert "declare allowed_hosts" in str(error.value)
    hosts = '["*.example.com", "localhost", "127.0.0.1"]'
    allowed = with_line(table, f"allowed_hosts = {hosts}")
    (loaded,) = load_http_tools(write_toml(allowed))
    assert loaded.spec.allowed_hosts == ["*.example.com", "localhost", "127.0.0.1"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("allowed_hosts = []", "allowed_hosts: must name at least one host"),
        ('allowed_hosts = ["API.example.com"]', "is not a lower-case host name"),
        ('allowed_hosts = ["*"]', "is not a lower-case host name"),
        ('allowed_hosts = ["h:80"]', "is not a lower-case host name"),
        ('allowed_hosts = ["example.com"]', "url: host '127.0.0.1' is not in allowed_hosts"),
    ],
)
def test_bad_allowed_hosts_are_refused(
    write_toml: Callable[[str], Path], line: str, message: str
) -> None:
    """An empty or malformed allow-list, or one that leaves out the URL's own host, is refused."""
    with pytest.raises(ConfigError) as error:
        load_http_tools(write_toml(with_line(MINIMAL_TABLE, line)))
    assert message in str(error.value)


def test_the_operation_id_must_reach_the_remote(write_toml: Callable[[str], Path]) -> None:
    """Without idempotency_header or {operation_id} in url the table is refused."""
    table = MINIMAL_TABLE.replace('idempotency_header = "Idempotency-Key"\n', "")
    with pytest.raises(ConfigError, match="the operation id must reach the remote"):
        load_http_tools(write_toml(table))
    keyed = table.replace("{target}/releases", "{target}/releases/{operation_id}")
    assert len(load_http_tools(write_toml(keyed))) == 1


def test_a_missing_environment_header_names_the_variable_not_secrets(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unset env_headers variable raises ConfigError naming it, and no header value."""
    monkeypatch.delenv("DEPLOY_TOKEN", raising=False)
    with pytest.raises(ConfigError) as error:
        load_http_tools(write_toml(VALID_TOML))
    text = str(error.value)
    assert "env_headers.Authorization: environment variable DEPLOY_TOKEN is not set" in text
    assert "s3cret" not in text


def test_a_header_value_with_a_newline_is_refused_without_echoing_it(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header value HTTP forbids is refused naming the header, never showing the value."""
    monkeypatch.setenv("DEPLOY_TOKEN", "s3cret\r\nX-Injected: 1")
    with pytest.raises(ConfigError, match="DEPLOY_TOKEN holds characters") as error:
        load_http_tools(write_toml(VALID_TOML))
    assert "s3cret" not in str(error.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    """A missing OUTBOX_CONFIG file raises ConfigError naming the variable and the path."""
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=f"OUTBOX_CONFIG: cannot read {path}"):
        load_http_tools(path)


def test_invalid_toml_names_the_line(write_toml: Callable[[str], Path]) -> None:
    """A TOML syntax error raises ConfigError naming the file and the line."""
    path = write_toml(MINIMAL_TABLE + "timeout_s = = 3\n")
    with pytest.raises(ConfigError, match=r"invalid TOML: .*line 7") as error:
        load_http_tools(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[tool."x"]\nkind = "http"\n', "unknown top-level key(s) tool"),
        ('tools = "x"\n', "tools must be a table"),
        ('[tools]\n"deploy.x" = 3\n', 'tools."deploy.x" must be a table'),
        (MINIMAL_TABLE.replace(NAME, "bad name"), "tool name 'bad name' is invalid"),
        (
            MINIMAL_TABLE.replace(f'"{NAME}"', NAME),
            'holds tables, not a tool: quote dotted names, [tools."deploy.create_release"]',
        ),
    ],
)
def test_a_malformed_document_is_refused(
    write_toml: Callable[[str], Path], text: str, message: str
) -> None:
    """A document that is not [tools."name"] tables raises ConfigError saying so."""
    with pytest.raises(ConfigError) as error:
        load_http_tools(write_toml(text))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("document", "path", "expected"),
    [
        ({"id": "rel-1"}, "id", "rel-1"),
        ({"id": 42}, "id", "42"),
        ({"data": {"id": "x"}}, "data.id", "x"),
        ({"items": [{"id": "a"}, {"id": "b"}]}, "items.1.id", "b"),
        ({"items": []}, "items.0.id", None),
        ({"id": ""}, "id", None),
        ({"id": "  "}, "id", None),
        ({"id": None}, "id", None),
        ({"id": True}, "id", None),
        ({"id": {"nested": 1}}, "id", None),
        ([{"id": "a"}], "0.id", "a"),
        ("text", "id", None),
    ],
)
def test_remote_ref_paths_resolve_only_to_non_empty_values(
    document: Any, path: str, expected: str | None
) -> None:
    """A dotted path resolves through objects and list indexes to a non-empty string or number."""
    assert resolve_ref(document, path) == expected


def test_url_placeholders_are_percent_encoded() -> None:
    """Placeholder values are percent-encoded as single segments, dots segments included."""
    template = "http://h/p/{target}/r?key={intent_key}&op={operation_id}"
    url = render_url(template, make_call(target="team a/b?c", intent_key="k&x=1"))
    assert str(url) == (
        "http://h/p/team%20a%2Fb%3Fc/r?key=k%26x%3D1&op=5d0c3f8e-0000-4000-8000-000000000001"
    )
    assert url.raw_path == "/p/team%20a%2Fb%3Fc/r"  # as sent: one segment, nothing decoded
    dots = render_url("http://h/p/{target}/r", make_call(target=".."))
    assert (str(dots), dots.raw_path) == ("http://h/p/%2E%2E/r", "/p/%2E%2E/r")


# --- load_tools ------------------------------------------------------------------------------

PYTHON_TOOLS = """
from outbox.tools import Applied, ToolCall, tool

@tool("billing.charge", timeout=5)
def charge(call: ToolCall) -> Applied:
    return Applied("ch_1")
"""


def test_load_tools_imports_modules_reads_the_file_and_marks_loaded(
    write_toml: Callable[[str], Path], tools_module: Callable[[str], str]
) -> None:
    """load_tools registers Python and HTTP tools and marks the core table complete."""
    module = tools_module(PYTHON_TOOLS)
    registry = load_tools(settings(tools=[module], config=write_toml(MINIMAL_TABLE)))
    assert registry is REGISTRY
    assert registry.names() == ["billing.charge", NAME]
    assert CONTRACTS.names() == ["billing.charge", NAME]
    assert CONTRACTS.loaded


def test_load_tools_is_idempotent(
    write_toml: Callable[[str], Path], tools_module: Callable[[str], str]
) -> None:
    """Loading twice, or again after clearing the tables, registers each tool exactly once."""
    configured = settings(tools=[tools_module(PYTHON_TOOLS)], config=write_toml(MINIMAL_TABLE))
    first = load_tools(configured).get("billing.charge")
    assert load_tools(configured).names() == ["billing.charge", NAME]
    REGISTRY.clear()
    CONTRACTS.clear()
    assert load_tools(configured).names() == ["billing.charge", NAME]
    assert REGISTRY.get("billing.charge") is first
    assert CONTRACTS.names() == ["billing.charge", NAME]


def test_load_tools_without_anything_configured_marks_loaded() -> None:
    """With no modules and no file the table is complete and empty: every tool is unknown."""
    assert load_tools(settings()).names() == []
    assert CONTRACTS.loaded


def test_an_unimportable_module_names_outbox_tools(tools_module: Callable[[str], str]) -> None:
    """A module that cannot be imported raises ConfigError naming OUTBOX_TOOLS and the module."""
    with pytest.raises(ConfigError, match="OUTBOX_TOOLS: cannot import tool module 'no_such_mod'"):
        load_tools(settings(tools=["no_such_mod"]))
    broken = tools_module("import no_such_dependency\n")
    with pytest.raises(ConfigError, match=f"'{broken}': No module named 'no_such_dependency'"):
        load_tools(settings(tools=[broken]))
    assert not CONTRACTS.loaded


def test_a_contradictory_tool_module_names_the_module(tools_module: Callable[[str], str]) -> None:
    """A module whose decorator is contradictory fails load_tools naming module and tool."""
    module = tools_module(PYTHON_TOOLS.replace("timeout=5", "timeout=0"))
    with pytest.raises(ConfigError, match=f"OUTBOX_TOOLS: tool module '{module}': tool 'billing"):
        load_tools(settings(tools=[module]))


def test_a_python_and_an_http_tool_cannot_share_a_name(
    write_toml: Callable[[str], Path], tools_module: Callable[[str], str]
) -> None:
    """A TOML table reusing a Python tool's name raises ConfigError naming the tool."""
    module = tools_module(PYTHON_TOOLS)
    table = MINIMAL_TABLE.replace(NAME, "billing.charge")
    with pytest.raises(ConfigError, match=r"tool 'billing\.charge' is defined twice"):
        load_tools(settings(tools=[module], config=write_toml(table)))
    assert not CONTRACTS.loaded


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"sent_timeout": 10},
            f"tool '{NAME}': timeout_s (10s) must be less than OUTBOX_SENT_TIMEOUT (10s)",
        ),
        (
            {"sent_timeout": 60, "sent_max_age": 300},
            f"tool '{NAME}': inflight_horizon_s (600s) must not exceed OUTBOX_SENT_MAX_AGE (300s)",
        ),
    ],
)
def test_load_tools_checks_contracts_against_the_settings(
    write_toml: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    overrides: dict[str, Any],
    message: str,
) -> None:
    """A tool whose deadlines do not fit the sweep's settings is refused; nothing is loaded."""
    monkeypatch.setenv("DEPLOY_TOKEN", "token")
    with pytest.raises(ConfigError) as error:
        load_tools(settings(config=write_toml(VALID_TOML), **overrides))
    assert message in str(error.value)
    assert not CONTRACTS.loaded
    assert NAME not in REGISTRY


def test_load_tools_checks_decorated_tools_too() -> None:
    """Tools registered before load_tools are checked against the settings as well."""

    @tool("billing.charge", timeout=30)
    def charge(call: ToolCall) -> DispatchResult:
        return Applied("ch_1")

    with pytest.raises(ConfigError, match=r"'billing\.charge': timeout_s \(30s\) must be less"):
        load_tools(settings(sent_timeout=30))


def test_tool_subclasses_answer_through_the_base_api() -> None:
    """A hand-written Tool subclass needs only a contract and dispatch; it has no lookup."""

    class Fixed(Tool):
        contract = ToolContract(name="fixed.tool")

        def dispatch(self, call: ToolCall) -> DispatchResult:
            return Applied("fixed")

    fixed = REGISTRY.register(Fixed())
    assert fixed.name == "fixed.tool"
    assert fixed.origin == "Fixed"
    assert not fixed.is_async_dispatch
    with pytest.raises(NotImplementedError):
        fixed.lookup(make_call())


def test_enqueue_refuses_an_unknown_tool_once_loaded(
    session: Session, write_toml: Callable[[str], Path]
) -> None:
    """After load_tools, enqueue accepts registered tools and refuses others naming the field."""
    load_tools(settings(config=write_toml(MINIMAL_TABLE)))
    known = api.enqueue(session, tool=NAME, target="project-a", payload={"v": 1})
    assert known.tool == NAME
    with pytest.raises(InvalidIntent, match=r"unknown tool 'billing\.charge'") as error:
        api.enqueue(session, tool="billing.charge", target="project-a", payload={"v": 1})
    assert error.value.field == "tool"
    session.rollback()

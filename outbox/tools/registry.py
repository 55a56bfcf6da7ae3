"""The tools this process can call, and :func:`load_tools`, which fills the registry.

Registering a tool also registers its contract in the core's table
(:data:`outbox.contracts.CONTRACTS`), so the core learns which tools exist without importing
this layer. :func:`load_tools` imports the modules named by ``OUTBOX_TOOLS``, reads the HTTP
tools of ``OUTBOX_CONFIG`` and its budgets (:data:`outbox.budgets.BUDGETS`; each must name
loaded tools), checks every contract against the sweep's settings and then
declares the table complete: from then on ``enqueue`` refuses unknown tools.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable

from outbox.budgets import BUDGETS, Budget, unknown_tools
from outbox.config import Settings, get_settings
from outbox.contracts import CONTRACTS, ContractTable, ToolContract
from outbox.errors import ConfigError
from outbox.logs import Action
from outbox.tools.base import Tool
from outbox.tools.budgets import budgets_from_toml
from outbox.tools.http import load_http_tools
from outbox.tools.http.load import read_config

log = logging.getLogger(__name__)


class ToolRegistry:
    """Tools by name. Thread-safe; a name belongs to one definition."""

    def __init__(self, contracts: ContractTable | None = None) -> None:
        #: The core table this registry keeps in step (default: the process-wide one).
        self.contracts = contracts if contracts is not None else CONTRACTS
        self._tools: dict[str, Tool] = {}
        # Tools by defining module, kept across clear(): an imported module does not run
        # again, so load_tools registers its tools from here after a clear().
        self._by_module: dict[str, dict[str, Tool]] = {}
        self._lock = threading.RLock()

    def register(self, tool: Tool) -> Tool:
        """Add ``tool`` (or replace the same definition) and register its contract.

        Raises :class:`ConfigError` naming the tool if another definition has its name.
        """
        with self._lock:
            self.check(tool)
            self._tools[tool.name] = tool
            if tool.module is not None:
                self._by_module.setdefault(tool.module, {})[tool.name] = tool
            self.contracts.register(tool.contract)
        return tool

    def check(self, tool: Tool) -> None:
        """Raise :class:`ConfigError` if registering ``tool`` would clash with another tool."""
        existing = self._tools.get(tool.name)
        if existing is not None and existing is not tool and not existing.same_definition(tool):
            raise ConfigError(
                f"tool {tool.name!r} is defined twice: by {existing.origin} and by {tool.origin}",
                tool=tool.name,
            )

    def register_module(self, module: str) -> list[str]:
        """Register again the tools that ``module`` defined into this registry (after a
        :meth:`clear`); returns their names."""
        with self._lock:
            tools = list(self._by_module.get(module, {}).values())
            for tool in tools:
                self.register(tool)
        return [tool.name for tool in tools]

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or ``None``."""
        return self._tools.get(name)

    def names(self) -> list[str]:
        """Registered tool names, sorted."""
        return sorted(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def clear(self) -> None:
        """Forget every registered tool (tests). The core table is left alone: clear
        :data:`~outbox.contracts.CONTRACTS` too to forget the contracts."""
        with self._lock:
            self._tools.clear()


#: The process-wide registry: decorated tools land here unless told otherwise.
REGISTRY = ToolRegistry()


def load_tools(
    settings: Settings | None = None, *, registry: ToolRegistry | None = None
) -> ToolRegistry:
    """Fill ``registry`` (default :data:`REGISTRY`) from ``settings`` and mark it complete.

    Imports every module of ``settings.tools`` (``OUTBOX_TOOLS``; their decorators register
    their tools), loads the HTTP tools of ``settings.config`` (``OUTBOX_CONFIG``), checks each
    contract against ``OUTBOX_SENT_TIMEOUT`` and ``OUTBOX_SENT_MAX_AGE``, then calls
    ``mark_loaded()`` on the core table. Idempotent. Raises :class:`ConfigError` naming the
    variable and the tool; on an error the table is not marked loaded.
    """
    settings = settings if settings is not None else get_settings()
    registry = registry if registry is not None else REGISTRY
    for module in settings.tools:
        _import_tools_module(module)
        registry.register_module(module)
    http_tools = load_http_tools(settings.config) if settings.config is not None else []
    for tool in http_tools:
        registry.check(tool)
    contracts = [t.contract for t in _registered(registry)] + [t.contract for t in http_tools]
    check_against_settings(contracts, settings)
    declared = _config_budgets(settings)
    known = {*registry.names(), *(tool.name for tool in http_tools)}
    if problems := unknown_tools(declared, known):
        raise ConfigError(f"OUTBOX_CONFIG {settings.config}: " + "; ".join(problems))
    if problems := unknown_tools(BUDGETS.all(), known):
        raise ConfigError("outbox.tools.budget: " + "; ".join(problems))
    for tool in http_tools:
        registry.register(tool)
    for budget in declared:
        BUDGETS.register(budget)
    registry.contracts.mark_loaded()
    log.info(
        "%d tool(s) loaded from %s",
        len(registry),
        tools_source(settings),
        extra={"action": Action.TOOLS_LOADED, "tools": ",".join(registry.names())},
    )
    return registry


def tools_source(settings: Settings) -> str:
    """Where the tools come from, as a log line says it: ``OUTBOX_CONFIG /etc/tools.toml``,
    ``OUTBOX_TOOLS a,b``, both, or ``nowhere (OUTBOX_CONFIG and OUTBOX_TOOLS unset)``."""
    sources = []
    if settings.config is not None:
        sources.append(f"OUTBOX_CONFIG {settings.config}")
    if settings.tools:
        sources.append(f"OUTBOX_TOOLS {','.join(settings.tools)}")
    return " and ".join(sources) or "nowhere (OUTBOX_CONFIG and OUTBOX_TOOLS unset)"


def check_against_settings(contracts: Iterable[ToolContract], settings: Settings) -> None:
    """Raise :class:`ConfigError` unless every contract fits the sweep's settings.

    ``OUTBOX_SENT_TIMEOUT`` must exceed each ``timeout_s`` (else the sweep checks a call that
    is still running) and ``OUTBOX_SENT_MAX_AGE`` must be at least each
    ``inflight_horizon_s`` (else a request that may still land goes to a human as stuck).
    """
    problems: list[str] = []
    for contract in contracts:
        if not settings.sent_timeout > contract.timeout_s:
            problems.append(
                f"tool {contract.name!r}: timeout_s ({contract.timeout_s:g}s) must be less "
                f"than OUTBOX_SENT_TIMEOUT ({settings.sent_timeout:g}s): the sweep would "
                "treat a call still in progress as stale"
            )
        if not settings.sent_max_age >= contract.inflight_horizon_s:
            problems.append(
                f"tool {contract.name!r}: inflight_horizon_s ({contract.inflight_horizon_s:g}s) "
                f"must not exceed OUTBOX_SENT_MAX_AGE ({settings.sent_max_age:g}s): a request "
                "that may still land would be handed to a human"
            )
    if problems:
        raise ConfigError("; ".join(problems))


def _config_budgets(settings: Settings) -> list[Budget]:
    """The ``[budgets."name"]`` of ``OUTBOX_CONFIG`` (validated; not registered yet)."""
    if settings.config is None:
        return []
    document = read_config(settings.config)
    return budgets_from_toml(settings.config, document["budgets"]) if "budgets" in document else []


def _registered(registry: ToolRegistry) -> list[Tool]:
    return [tool for name in registry.names() if (tool := registry.get(name)) is not None]


def _import_tools_module(module: str) -> None:
    if module.startswith("."):
        raise ConfigError(f"OUTBOX_TOOLS: {module!r} is relative; name the module in full")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"OUTBOX_TOOLS: cannot import tool module {module!r}: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"OUTBOX_TOOLS: tool module {module!r}: {exc}") from exc

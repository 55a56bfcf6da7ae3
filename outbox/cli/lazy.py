"""A command group that imports a command's module only when that command runs (issue 33).

``outbox --version`` and ``outbox --help`` import no command module at all: the root help
lists the commands from a static table (:class:`LazyCommand`: name, module, one-line help),
whose one-line helps a test keeps equal to the commands' own. ``outbox ops list`` imports
``outbox.cli.ops`` alone, and the command builds its click command as Typer would have
built it eagerly (with the root's markup mode).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import typer
from typer.core import TyperCommand, TyperGroup
from typer.main import get_group

#: The root's rich markup mode, which Typer hands down to every sub-command it builds.
MARKUP_MODE: Final = "markdown"


@dataclass(frozen=True)
class LazyCommand:
    """One top-level command: where it lives and what the root help says of it."""

    #: The module defining it, imported only when the command runs (or its own help shows).
    module: str
    #: A ``typer.Typer`` (a group of commands) or a command function in ``module``.
    attribute: str
    #: Its line in ``outbox --help``: the first paragraph of its help, as Typer shows it.
    summary: str
    #: Keyword arguments of ``Typer.command`` (a function only), e.g. ``no_args_is_help``.
    options: Mapping[str, Any] = field(default_factory=dict)

    def load(self, name: str) -> typer.Typer:
        """Import the module: its Typer app or the command function, registered as ``name``."""
        target = getattr(importlib.import_module(self.module), self.attribute)
        holder = typer.Typer(rich_markup_mode=MARKUP_MODE, add_completion=False)
        if isinstance(target, typer.Typer):
            holder.add_typer(target, name=name)
        else:
            holder.command(name, **self.options)(target)
        return holder


class _Commands(Mapping[str, Any]):
    """The group's ``commands``: the table's names, each built on first access."""

    def __init__(self, table: Mapping[str, LazyCommand]) -> None:
        self._table = table
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            holder = self._table[name].load(name)
            self._built[name] = get_group(holder).commands[name]
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class LazyGroup(TyperGroup):
    """The root ``outbox`` group over :data:`outbox.cli.COMMANDS`."""

    #: The table, set by :func:`lazy_group`; the class attribute is what Typer instantiates.
    table: Mapping[str, LazyCommand] = {}

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = _Commands(self.table)  # type: ignore[assignment]
        self._listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        """The table's names, in its order (Typer's own would build every command)."""
        return list(self.table)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        """The command ``cmd_name``: its stand-in while the help lists them, else the real one."""
        if cmd_name not in self.table:
            return None
        if self._listing:
            return TyperCommand(name=cmd_name, help=self.table[cmd_name].summary)
        return self.commands[cmd_name]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """The root help, listing the commands from the table without importing them."""
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


def lazy_group(table: Mapping[str, LazyCommand]) -> type[LazyGroup]:
    """A :class:`LazyGroup` class over ``table`` (Typer's ``cls=``, which it instantiates)."""
    return type("OutboxGroup", (LazyGroup,), {"table": table})

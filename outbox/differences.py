"""Where two JSON values differ, named as a person or a model reads a field: ``payload.amount``.

An intent key reused with another payload is refused (:class:`outbox.errors.IntentConflict`);
naming the payload's own fields that differ (not just "payload") tells the caller what to fix.
The Python API, the HTTP API and the MCP server word it alike from here.
"""

from __future__ import annotations

from typing import Any


def differing_paths(old: Any, new: Any, prefix: str = "payload") -> list[str]:
    """The dotted paths at which two JSON values differ (``payload.amount``,
    ``payload.items.0``): where both are objects (or both arrays of one length), the
    members that differ; else the path itself."""
    if isinstance(old, dict) and isinstance(new, dict):
        paths: list[str] = []
        for name in sorted(set(old) | set(new), key=str):
            if name not in old or name not in new:
                paths.append(f"{prefix}.{name}")
            else:
                paths += differing_paths(old[name], new[name], f"{prefix}.{name}")
        return paths
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            path
            for index, (a, b) in enumerate(zip(old, new, strict=True))
            for path in differing_paths(a, b, f"{prefix}.{index}")
        ]
    same = old == new and type(old) is type(new)
    return [] if same else [prefix]

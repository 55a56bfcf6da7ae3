"""Test doubles that are real services: the reference remote for tests, demos and benchmarks.

``from outbox.testing import DeployService`` (see :mod:`outbox.testing.deploy_service`). The
import is lazy so that ``python -m outbox.testing.deploy_service`` does not load the module
twice, and importing this package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.testing.deploy_service import FAULT_MODES, DeployService, Effect

__all__ = ["FAULT_MODES", "DeployService", "Effect"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from outbox.testing import deploy_service  # noqa: PLC0415 - lazy on purpose, see above

        return getattr(deploy_service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The reference service's one error type."""

from __future__ import annotations


class DeployServiceError(ValueError):
    """The deploy service cannot run with this configuration."""

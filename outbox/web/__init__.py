"""The HTTP API (``outbox api``, docs/api.md): FastAPI on uvicorn, over the Python API.

An outer layer like the workers: only the CLI imports it, and it imports only the core.
"""

from outbox.web.app import create_app

__all__ = ["create_app"]

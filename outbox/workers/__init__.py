"""Dispatch workers: the Celery app, the dispatch protocol, advisory locks, the tools."""

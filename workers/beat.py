"""beat's scheduler, made to recover from a broker outage (celery/celery#8845).

Celery's scheduler opens its producer once; when a publish fails because the broker (or, on
the database broker, PostgreSQL) went away, the producer's channel stays closed and every
later run fails with "channel disconnected", forever: the sweeps stop and `sent` and
`unknown` rows wait. After a failed publish this scheduler drops its producer and
connection, so the next run opens new ones and the schedule resumes once the broker is back.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import Any

from celery.beat import PersistentScheduler

log = logging.getLogger(__name__)


class RecoveringScheduler(PersistentScheduler):  # type: ignore[misc]
    """:class:`celery.beat.PersistentScheduler` that reconnects after a failed publish."""

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Publish ``entry``; on failure, forget the connection, then let beat log the error."""
        try:
            return super().apply_async(entry, producer=producer, advance=advance, **kwargs)
        except Exception:
            self.reset_connection()
            raise

    def reset_connection(self) -> None:
        """Drop the cached producer and connection; the next publish opens new ones."""
        self.__dict__.pop("producer", None)
        connection = self.__dict__.pop("connection", None)
        if connection is not None:
            with suppress(Exception):  # the connection is likely dead already
                connection.collect()
        log.warning(
            "beat could not publish; reconnecting to the broker for the next run",
            extra={"action": "beat_reconnect"},
        )

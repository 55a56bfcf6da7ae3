"""beat's scheduler, made to recover from a broker outage (celery/celery#8845).

Celery's scheduler opens its producer once; when a publish fails because the broker (or, on
the database broker, PostgreSQL) went away, the producer's channel stays closed and every
later run fails with "channel disconnected", forever: the sweeps stop and `sent` and
`unknown` rows wait. After a failed publish this scheduler drops its producer and
connection, so the next run opens new ones and the schedule resumes once the broker is back.

Beat's intervals are durations, so they are measured on the monotonic clock: the schedule
reads the time with :func:`steady_now`, which a step of the host's clock (NTP, an operator)
does not move, and an entry whose stored last run lies ahead of the clock (the clock was set
back while beat was stopped) runs one interval after start instead of after the step plus
the interval. Celery's own clock would have paused every sweep for as long as the step.
"""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.beat import PersistentScheduler

from outbox.logs import Action

log = logging.getLogger(__name__)

_WALL_AT_START = datetime.now(UTC)
_MONOTONIC_AT_START = time.monotonic()


def steady_now() -> datetime:
    """The wall clock as this process read it at start, advanced by the monotonic clock.

    For beat's schedule (``celery.schedules.schedule(nowfun=steady_now)``): an interval is
    measured on it as a duration, whatever happens to the host's clock meanwhile.
    """
    return _WALL_AT_START + timedelta(seconds=time.monotonic() - _MONOTONIC_AT_START)


class RecoveringScheduler(PersistentScheduler):  # type: ignore[misc]
    """:class:`celery.beat.PersistentScheduler` that reconnects after a failed publish."""

    def setup_schedule(self) -> None:
        """Load the stored schedule; a last run stored ahead of now counts as just now."""
        super().setup_schedule()
        for entry in self.schedule.values():
            now = entry.default_now()
            last = entry.last_run_at
            if last is not None and entry.schedule.maybe_make_aware(last) > now:
                entry.last_run_at = now

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
            extra={"action": Action.BEAT_RECONNECT},
        )

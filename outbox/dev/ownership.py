"""Whose database is it: a destructive dev run empties only a database it created itself,
or one its caller names explicitly (``--i-own-this-database URL``).

``outbox dev scenario`` empties the outbox's tables before it runs. Pointed by habit at a
shell's ``OUTBOX_DATABASE_URL`` (production's, a colleague's), that would erase real intents;
so a database it did not create is refused unless the caller names that very database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outbox.errors import DatabaseUnavailable

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

# SQLAlchemy's URL handling is imported by the functions that compare or print a URL, not
# with the flag's name, which `outbox dev --help` shows (issue 33).

#: The flag that names a database the caller owns and lets a run empty it.
OWN_DATABASE_FLAG = "--i-own-this-database"


class NotOwned(ValueError):
    """A destructive run was pointed at a database it did not create, and nobody named it."""


def _identity(url: str) -> URL:
    """What names a database in ``url``: server, port, user, database and query.

    The password is left out: it does not say which database it is, and the caller may
    name the URL as printed (passwords masked). So is the driver (``postgresql://``,
    ``postgres://`` and ``postgresql+psycopg://`` are the same database).
    """
    from sqlalchemy.engine import URL  # noqa: PLC0415

    from outbox import urls  # noqa: PLC0415

    try:
        parsed = urls.parse(url)
    except DatabaseUnavailable as exc:
        raise NotOwned(f"{OWN_DATABASE_FLAG}: {url!r} is not a PostgreSQL URL") from exc
    return URL.create(
        parsed.get_backend_name(),
        username=parsed.username,
        host=parsed.host,
        port=parsed.port,
        database=parsed.database,
        query=parsed.query,
    )


def same_database(url: str, other: str) -> bool:
    """Whether ``url`` and ``other`` name one database (see :func:`_identity`)."""
    return _identity(url) == _identity(other)


def confirm_owned(url: str, named: str | None, *, doing: str) -> None:
    """Return if ``named`` names the database of ``url``; else :class:`NotOwned`, one line.

    ``doing`` says what the run would do to it, e.g. ``"outbox dev scenario empties the
    outbox tables of"``.
    """
    from outbox.db import redact  # noqa: PLC0415

    shown = redact(url)
    if named is None:
        raise NotOwned(
            f"{doing} {shown}, a database it did not create: pass {OWN_DATABASE_FLAG} {shown} "
            "if it is yours to empty, or leave OUTBOX_DATABASE_URL unset to run on a "
            "throw-away cluster of its own"
        )
    if not same_database(url, named):
        raise NotOwned(
            f"{OWN_DATABASE_FLAG} names {redact(named)}, not {shown}: refusing to touch a "
            "database nobody named"
        )

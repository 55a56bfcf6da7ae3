"""The reference service's ledger: every effect it committed, in SQLite."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from outbox.dev.service.errors import DeployServiceError

#: What recording a create request did.
Outcome = Literal["created", "deduplicated", "key_reused"]


@dataclass(frozen=True, slots=True)
class Effect:
    """One release the service committed: the remote's side of an action."""

    id: str
    target: str
    key: str
    payload: Any
    created_at: str

    def to_dict(self) -> dict[str, Any]:
        """The release as the service answers it."""
        return {
            "id": self.id,
            "target": self.target,
            "key": self.key,
            "payload": self.payload,
            "created_at": self.created_at,
        }


class LedgerClosed(RuntimeError):
    """The service was stopped; its ledger is closed."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused, even after a clear
    target TEXT NOT NULL,
    key TEXT NOT NULL,
    payload TEXT NOT NULL,                  -- canonical JSON
    created_at REAL NOT NULL                -- seconds since the epoch, the service's clock
);
CREATE INDEX IF NOT EXISTS effects_by_key ON effects (key, seq);
"""
# Each statement written out whole: no SQL is built from strings, even here.
_LATEST_OF_KEY = (
    "SELECT seq, target, key, payload, created_at FROM effects "
    "WHERE key = ? ORDER BY seq DESC LIMIT 1"
)
_FIRST_OF_TARGET_AND_KEY = (
    "SELECT seq, target, key, payload, created_at FROM effects "
    "WHERE key = ? AND target = ? ORDER BY seq LIMIT 1"
)
_ALL = "SELECT seq, target, key, payload, created_at FROM effects ORDER BY seq"
_INSERT = "INSERT INTO effects (target, key, payload, created_at) VALUES (?, ?, ?, ?)"
_COUNTS_BY_KEY = "SELECT key, count(*) FROM effects GROUP BY key ORDER BY min(seq)"
_CLEAR = "DELETE FROM effects"
#: A row of the three reads above.
_Row = tuple[int, str, str, str, float]


class Ledger:
    """Every effect the service committed, in SQLite: in memory, or a file that outlives it.

    One connection behind one lock: the lock also makes check-then-insert atomic, so
    concurrent requests with one key cannot both create an effect when dedup is on.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._db = sqlite3.connect(
                ":memory:" if path is None else os.fspath(path),
                check_same_thread=False,
                isolation_level=None,  # autocommit: each statement is its own transaction
            )
            if path is not None:
                # WAL with synchronous=NORMAL survives a killed process, which is what a
                # restart test needs, at a fraction of the cost of an fsync per effect.
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise DeployServiceError(f"cannot open the ledger {path}: {exc}") from exc

    def record(
        self, target: str, key: str, payload: str, window_s: float | None
    ) -> tuple[Outcome, Effect]:
        """Commit a new effect, or with a window return the key's effect still inside it."""
        with self._lock:
            self._check_open()
            now = time.time()
            if window_s is not None:
                row: _Row | None = self._db.execute(_LATEST_OF_KEY, (key,)).fetchone()
                if row is not None and now - row[4] < window_s:
                    same = row[1] == target and row[3] == payload
                    return ("deduplicated" if same else "key_reused"), _effect(row)
            cursor = self._db.execute(_INSERT, (target, key, payload, now))
            seq = cursor.lastrowid
        assert seq is not None  # noqa: S101 - sqlite sets it after an INSERT
        return "created", _effect((seq, target, key, payload, now))

    def first(self, target: str, key: str) -> Effect | None:
        """The first effect with this key for this target, if any."""
        with self._lock:
            self._check_open()
            row: _Row | None = self._db.execute(_FIRST_OF_TARGET_AND_KEY, (key, target)).fetchone()
        return None if row is None else _effect(row)

    def effects(self) -> list[Effect]:
        """Every effect, in commit order."""
        with self._lock:
            self._check_open()
            rows: list[_Row] = self._db.execute(_ALL).fetchall()
        return [_effect(row) for row in rows]

    def counts_by_key(self) -> dict[str, int]:
        """How many effects each key has, keys in order of their first effect."""
        with self._lock:
            self._check_open()
            rows: list[tuple[str, int]] = self._db.execute(_COUNTS_BY_KEY).fetchall()
        return dict(rows)

    def clear(self) -> None:
        """Forget every effect (ids keep counting up)."""
        with self._lock:
            self._check_open()
            self._db.execute(_CLEAR)

    def close(self) -> None:
        """Close the connection; later calls raise :class:`LedgerClosed`."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerClosed


def _effect(row: _Row) -> Effect:
    seq, target, key, payload, created_at = row
    stamp = datetime.fromtimestamp(created_at, UTC).isoformat(timespec="microseconds")
    return Effect(f"rel-{seq}", target, key, json.loads(payload), stamp)

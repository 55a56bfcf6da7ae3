"""The reference service's ledger: every effect it committed, in SQLite.

Two kinds of effect share one sequence, so their order is the order they were committed in:
a ``release`` (``POST /projects/{target}/releases``, id ``rel-N``) and a ``rollback`` of one
(``POST /projects/{target}/rollbacks``, id ``rb-N``).
"""

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

#: What recording a request did.
Outcome = Literal["created", "deduplicated", "key_reused"]
#: What an effect is: a release created, or a release rolled back.
EffectKind = Literal["release", "rollback"]
#: The id prefix of each kind: ``rel-3``, ``rb-4`` (one sequence for both).
_PREFIXES: dict[str, EffectKind] = {"rel": "release", "rb": "rollback"}
_PREFIX_OF: dict[EffectKind, str] = {kind: prefix for prefix, kind in _PREFIXES.items()}


@dataclass(frozen=True, slots=True)
class Effect:
    """One effect the service committed (a release, or a rollback of one): the remote's side
    of an action."""

    id: str
    target: str
    key: str
    payload: Any
    created_at: str
    kind: EffectKind = "release"

    def to_dict(self) -> dict[str, Any]:
        """The effect as the service answers it."""
        return {
            "id": self.id,
            "kind": self.kind,
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
    created_at REAL NOT NULL,               -- seconds since the epoch, the service's clock
    kind TEXT NOT NULL DEFAULT 'release'    -- 'release' or 'rollback'
);
CREATE INDEX IF NOT EXISTS effects_by_key ON effects (key, seq);
"""
# A ledger file written before rollbacks existed has no kind: every effect in it is a release.
_COLUMNS = "SELECT name FROM pragma_table_info('effects')"
_ADD_KIND = "ALTER TABLE effects ADD COLUMN kind TEXT NOT NULL DEFAULT 'release'"
# Each statement written out whole: no SQL is built from strings, even here.
_LATEST_OF_KEY = (
    "SELECT seq, target, key, payload, created_at, kind FROM effects "
    "WHERE key = ? AND kind = ? ORDER BY seq DESC LIMIT 1"
)
_FIRST_OF_TARGET_AND_KEY = (
    "SELECT seq, target, key, payload, created_at, kind FROM effects "
    "WHERE key = ? AND target = ? AND kind = ? ORDER BY seq LIMIT 1"
)
_BY_SEQ = (
    "SELECT seq, target, key, payload, created_at, kind FROM effects "
    "WHERE seq = ? AND target = ? AND kind = ?"
)
_ALL = "SELECT seq, target, key, payload, created_at, kind FROM effects ORDER BY seq"
_INSERT = "INSERT INTO effects (target, key, payload, created_at, kind) VALUES (?, ?, ?, ?, ?)"
_COUNTS_BY_KEY = "SELECT key, count(*) FROM effects GROUP BY key ORDER BY min(seq)"
_CLEAR = "DELETE FROM effects"
#: A row of the reads above.
_Row = tuple[int, str, str, str, float, str]


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
            if "kind" not in {name for (name,) in self._db.execute(_COLUMNS)}:
                self._db.execute(_ADD_KIND)
        except sqlite3.Error as exc:
            raise DeployServiceError(f"cannot open the ledger {path}: {exc}") from exc

    def record(
        self,
        target: str,
        key: str,
        payload: str,
        window_s: float | None,
        kind: EffectKind = "release",
    ) -> tuple[Outcome, Effect]:
        """Commit a new effect of ``kind``, or with a window return the key's effect of that
        kind still inside it."""
        with self._lock:
            self._check_open()
            now = time.time()
            if window_s is not None:
                row: _Row | None = self._db.execute(_LATEST_OF_KEY, (key, kind)).fetchone()
                if row is not None and now - row[4] < window_s:
                    same = row[1] == target and row[3] == payload
                    return ("deduplicated" if same else "key_reused"), _effect(row)
            cursor = self._db.execute(_INSERT, (target, key, payload, now, kind))
            seq = cursor.lastrowid
        assert seq is not None  # noqa: S101 - sqlite sets it after an INSERT
        return "created", _effect((seq, target, key, payload, now, kind))

    def first(self, target: str, key: str, kind: EffectKind = "release") -> Effect | None:
        """The first effect of ``kind`` with this key for this target, if any."""
        with self._lock:
            self._check_open()
            row: _Row | None = self._db.execute(
                _FIRST_OF_TARGET_AND_KEY, (key, target, kind)
            ).fetchone()
        return None if row is None else _effect(row)

    def release(self, target: str, release_id: str) -> Effect | None:
        """The release ``release_id`` (``rel-N``) of ``target``, if the service created it."""
        prefix, _, number = release_id.partition("-")
        if _PREFIXES.get(prefix) != "release" or not number.isdecimal():
            return None
        with self._lock:
            self._check_open()
            row: _Row | None = self._db.execute(
                _BY_SEQ, (int(number), target, "release")
            ).fetchone()
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
    seq, target, key, payload, created_at, stored_kind = row
    kind: EffectKind = "rollback" if stored_kind == "rollback" else "release"
    stamp = datetime.fromtimestamp(created_at, UTC).isoformat(timespec="microseconds")
    return Effect(f"{_PREFIX_OF[kind]}-{seq}", target, key, json.loads(payload), stamp, kind)

"""What the relay's doorbell costs the agent's commit: enqueue with and without NOTIFY.

Runs 8 agent threads, each enqueueing one intent per transaction, three ways side by side
in one run (the machine is noisy; compare ratios, not absolute numbers):

* ``raw insert``  - an INSERT+COMMIT of a row of the same shape, the ceiling;
* ``enqueue, relay busy`` - no relay is idle, so enqueue rings no bell (the loaded case);
* ``enqueue, relay idle`` - a relay sleeps on LISTEN, so every enqueue NOTIFYs.

Usage: python bench/doorbell.py [--url postgresql://...] [--threads 8] [--per-thread 1500]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

from sqlalchemy import text
from sqlalchemy.orm import Session

from outbox import api, migrate
from outbox.db import create_engine


def _run(engine, threads: int, per_thread: int, body) -> float:  # type: ignore[no-untyped-def]
    barrier = threading.Barrier(threads + 1)

    def agent() -> None:
        with Session(engine) as session:
            barrier.wait()
            for _ in range(per_thread):
                with session.begin():
                    body(session)

    workers = [threading.Thread(target=agent) for _ in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    return threads * per_thread / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--per-thread", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = create_engine(args.url, pool_size=args.threads + 2)
    migrate.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS bench_raw (LIKE outbox.operations)"))

    def raw(session: Session) -> None:
        session.execute(
            text(
                "INSERT INTO bench_raw (id, intent_key, tool, target, payload, payload_hash, "
                "state, attempts, checks, maybe_applied, metadata, created_at, updated_at, "
                "available_at) VALUES (gen_random_uuid(), gen_random_uuid()::text, 'bench.tool', "
                "'t', '{\"v\": 1}', repeat('a', 64), 'planned', 0, 0, false, '{}', "
                "clock_timestamp(), clock_timestamp(), clock_timestamp())"
            )
        )

    def enqueue(session: Session) -> None:
        api.enqueue(
            session, tool="bench.tool", target="t", payload={"v": 1}, intent_key=uuid.uuid4().hex
        )

    def set_idle(idle: bool) -> None:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM outbox.relays"))
            if idle:
                conn.execute(
                    text(
                        "INSERT INTO outbox.relays (name, pid, host, idle) "
                        "VALUES ('bench', 0, 'bench', true)"
                    )
                )

    results: dict[str, list[float]] = {
        "raw insert": [],
        "enqueue, relay busy": [],
        "enqueue, relay idle": [],
    }
    for _ in range(args.rounds):
        results["raw insert"].append(_run(engine, args.threads, args.per_thread, raw))
        set_idle(False)
        results["enqueue, relay busy"].append(_run(engine, args.threads, args.per_thread, enqueue))
        set_idle(True)
        results["enqueue, relay idle"].append(_run(engine, args.threads, args.per_thread, enqueue))
        set_idle(False)
    base = statistics.median(results["raw insert"])
    print(f"{'case':24} {'median/s':>9} {'min/s':>7} {'max/s':>7} {'vs raw':>7}")
    for name, rates in results.items():
        median = statistics.median(rates)
        print(f"{name:24} {median:9.0f} {min(rates):7.0f} {max(rates):7.0f} {median / base:7.2f}")
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE bench_raw"))
        conn.execute(text("DELETE FROM outbox.operations WHERE tool = 'bench.tool'"))


if __name__ == "__main__":
    main()

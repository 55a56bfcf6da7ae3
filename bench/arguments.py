"""The command line every benchmark shares (``add_common_arguments``).

* ``--url``: a PostgreSQL server on which the benchmark may create and drop databases named
  ``bench_<hex>`` (any PostgreSQL URL: TCP, or a Unix socket as the embedded server gives);
  default ``OUTBOX_BENCH_URL``, else ``OUTBOX_TEST_DATABASE_URL``, else the local server;
* ``--rounds``: every case runs once per round, the cases side by side within a round (their
  order rotating from round to round), so a noisy machine disturbs them alike (``rounds``);
* ``--smoke``: a run of a few seconds that only proves the script still works;
* ``--json FILE``: every value of every round, for comparing runs later (``report``).

The latency benchmarks (``peers.py``, ``pipeline.py``) add ``--contend PCT``
(:func:`add_contend_argument`): every round under emulated steal (``contend``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from contend import checked_share

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def default_url() -> str:
    """``OUTBOX_BENCH_URL``, else ``OUTBOX_TEST_DATABASE_URL``, else the local server."""
    return (
        os.environ.get("OUTBOX_BENCH_URL")
        or os.environ.get("OUTBOX_TEST_DATABASE_URL")
        or DEFAULT_URL
    )


def add_common_arguments(parser: argparse.ArgumentParser, *, rounds: int = 3) -> None:
    """``--url``, ``--rounds``, ``--smoke`` and ``--json``, the same in every script."""
    parser.add_argument(
        "--url",
        default=default_url(),
        help="PostgreSQL server where bench_* databases may be created "
        "(default: OUTBOX_BENCH_URL, OUTBOX_TEST_DATABASE_URL or %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does it still run")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every round's values")


def _share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a percentage") from None
    try:
        return checked_share(share)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_contend_argument(parser: argparse.ArgumentParser) -> None:
    """``--contend PCT``: run every round under emulated steal (:mod:`contend`)."""
    parser.add_argument(
        "--contend",
        type=_share,
        metavar="PCT",
        help="run under emulated steal: a real-time co-tenant takes PCT %% of every core in "
        "bursts (bench/contend.py; needs root for real-time, else gentler)",
    )

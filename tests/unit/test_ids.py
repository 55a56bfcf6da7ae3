"""Operation ids made at enqueue (``outbox.ids``): UUIDv7, in the order they were made."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from outbox import ids


def test_an_id_is_a_version_7_uuid_carrying_the_time_it_was_made() -> None:
    before = time.time_ns() // 1_000_000
    made = ids.new_operation_id()
    after = time.time_ns() // 1_000_000
    assert (made.version, made.variant) == (7, uuid.RFC_4122)
    assert before <= made.int >> 80 <= after


def test_ids_sort_in_the_order_they_were_made_within_a_millisecond_and_across_threads() -> None:
    made: list[list[uuid.UUID]] = [[] for _ in range(4)]

    def make(into: list[uuid.UUID]) -> None:
        into.extend(ids.new_operation_id() for _ in range(20_000))

    threads = [threading.Thread(target=make, args=(one,)) for one in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [one for each in made for one in each]
    assert len(set(every)) == len(every)
    for each in made:  # each thread's own ids, in its order
        assert each == sorted(each)


def test_an_id_after_one_whose_random_bits_are_full_carries_into_the_bits_above(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    last = ids.new_operation_id().int | ((1 << 62) - 1)
    # An hour ahead of the clock, low bits all ones: the next id must follow it. (A millisecond
    # ahead was caught up by the clock itself on a loaded machine: the next id then carried a
    # later time of its own, and random low bits.)
    monkeypatch.setattr(ids, "_last", last + (3_600_000 << 80))
    made = ids.new_operation_id()
    assert made.int > ids._last - 1
    assert (made.version, made.variant) == (7, uuid.RFC_4122)
    assert made.int & ((1 << 62) - 1) == 0

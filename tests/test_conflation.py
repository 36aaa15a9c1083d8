"""Conflation rules: rounding (78 -> 0, 547 -> 500, 887 -> 800) and Table 5.1's aggregation."""

from __future__ import annotations

import pytest

from migratory.conflation import ConflationBuffer, next_boundary, round_conflation


@pytest.mark.parametrize(
    ("asked", "used"), [(78, 0), (547, 500), (887, 800), (0, 0), (-5, 0), (100, 100), (5000, 5000)]
)
def test_conflation_time_is_cut_down_to_100ms(asked: int, used: int) -> None:
    assert round_conflation(asked) == used


def test_seed_conflation_table_aggregation() -> None:
    # 10:12:41 content=195 ask=192; 10:12:43 content=196 bid=197 -> at 10:12:45 one message
    buffer = ConflationBuffer(5000)
    assert buffer.add("/Stocks/NYSE/IBM", b"195", {"ask": "192"}, 3, 1, True) is True
    assert buffer.add("/Stocks/NYSE/IBM", b"196", {"bid": "197"}, 4, 1, True) is False
    (item,) = buffer.drain()
    assert item.content == b"196"
    assert dict(item.fields) == {"ask": "192", "bid": "197"}
    assert item.seq == 4
    # 10:12:50, 10:12:55: nothing new, nothing sent
    assert buffer.drain() == []


def test_boundaries_are_clock_aligned() -> None:
    assert next_boundary(10_000, 5000) == 15_000
    assert next_boundary(12_345, 5000) == 15_000
    assert next_boundary(14_999, 100) == 15_000


def test_discard() -> None:
    buffer = ConflationBuffer(100)
    buffer.add("/a/b", b"x", {}, 1, 1, True)
    buffer.discard("/a/b")
    assert len(buffer) == 0

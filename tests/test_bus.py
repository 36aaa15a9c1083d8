"""Bus frames of both layers: every kind round-trips, streams split anywhere, garbage is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migratory import bus as b
from migratory.message import Snapshot
from migratory.replica import Entry, SubjectSync

ENTRY = Entry(7, 42, b"\x00payload", {"f": "v", "g": ""}, False, "pub-1")
FRAMES: list[b.BusFrame] = [
    b.Hello(3, b"proof"),
    b.Forward(9, "/a/b", b"body", {"x": "y"}, True, True, {"addr": "127.0.0.1"}, "id-9", 2),
    b.ForwardStatus(9, 3, 12, "why", 65),
    b.Published("/a/b", b"c", {"k": "v"}, 5, 6, False, True, "p"),
    b.Interest("/a/b", 12),
    b.SyncSubject(SubjectSync("/a/b", 6, 5, Snapshot("/a/b", b"s", {"q": "r"}, 4, 6), (ENTRY, ENTRY)), more=True),
    b.SyncSubject(SubjectSync("/a/b", 6, 5, None, ())),
    b.Challenge(1, 77, b"n" * 32),
    b.Proof(2, 78, b"m" * 32, b"h" * 32),
    b.Welcome(b"w" * 32),
    b.Heartbeat(4, True, False, True, 9, 1000, 990, 3, b'{"clients": 1}'),
    b.TableFrame(3, (0, 1, 2), tuple(range(64))),
    b.SyncRequest(11, ((1, 65), (2, 66)), everything=True, reply=False),
    b.SyncDone(11, ((1, 70),)),
    b.Ack("/a/b", 65, 17),
    b.ClusterInfo(True, b"{}"),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_frame_round_trips(frame: b.BusFrame) -> None:
    data = b.encode(frame)
    assert b.BusDecoder().feed(data) == [frame]


@given(st.lists(st.integers(1, 50), max_size=20))
def test_a_stream_of_frames_splits_anywhere(cuts: list[int]) -> None:
    stream = b"".join(b.encode(f) for f in FRAMES)
    decoder = b.BusDecoder()
    out: list[b.BusFrame] = []
    pos = 0
    for cut in cuts:
        out += decoder.feed(stream[pos : pos + cut])
        pos += cut
    out += decoder.feed(stream[pos:])
    assert out == FRAMES


@settings(max_examples=500)
@given(st.binary(min_size=2, max_size=200))
def test_garbage_bodies_raise_bus_error_only(body: bytes) -> None:
    """Any body either fails with BusError or is a frame that survives its own round trip."""
    try:
        frame = b.decode(body)
    except b.BusError:
        return
    assert b.decode(b.encode(frame)[4:]) == frame


def test_oversized_and_lying_frames_are_refused() -> None:
    with pytest.raises(b.BusError, match="at most"):
        b.BusDecoder(max_frame=1000).feed(b"\x00\x01\x00\x00rest")
    lying = bytes((b.Kind.TABLE, 0)) + b"\x00" * 8 + b"\xff\xff\xff\xff"
    with pytest.raises(b.BusError, match="more items"):
        b.decode(lying)
    with pytest.raises(b.BusError, match="trailing"):
        b.decode(b.encode(b.Welcome(b"x"))[4:] + b"junk")


class _Recorder:
    """Stands in for a link's transport: what each write carried."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


@pytest.mark.parametrize(("batching", "expected"), [(0.0, [b"one", b"two"]), (1.0, [b"onetwo"])])
def test_bus_batching_joins_frames_of_separate_loop_turns(batching: float, expected: list[bytes]) -> None:
    """BusBatchingTime: frames written in different loop turns leave in one write (one wake-up of the
    receiving process); without it, each loop turn's frames leave at its end."""
    import asyncio

    from migratory.server.bus import Bus, _Outbound

    async def scenario() -> list[bytes]:
        bus = Bus(0, [1], "test", b"secret", lambda frame, peer: None, lambda peer: None, batching=batching)
        peer = bus.peers[1]
        peer.up = True
        peer.writer = _Outbound()
        recorder = _Recorder()
        peer.writer.transport = recorder  # type: ignore[assignment]
        assert bus.send_raw(1, b"one")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert bus.send_raw(1, b"two")
        await asyncio.sleep(batching + 0.1)
        return recorder.writes

    assert asyncio.run(scenario()) == expected

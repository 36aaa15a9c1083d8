"""Bus frames of both layers: every kind round-trips, streams split anywhere, garbage is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
    b.Leaving(2, "stopping (SIGTERM)"),
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
        self.closed = False
        self.aborted = False
        self.unread = 0  # bytes the peer has not read yet (what the transport would still hold)
        self.protocol: Any = None  # paused above HIGH_WATER and resumed when read, as a real transport does
        self.paused = False

    def write(self, data: bytes) -> None:
        if self.closed:  # as uvloop's transports do
            raise RuntimeError("unable to perform operation on <UnixTransport closed=True>; the handler is closed")
        self.writes.append(data)
        self.unread += len(data)
        from migratory.server.node.bus import HIGH_WATER

        if self.unread > HIGH_WATER and self.protocol is not None and not self.paused:
            self.paused = True
            self.protocol.pause_writing()

    def read_all(self) -> None:
        """The peer reads everything written so far."""
        self.unread = 0
        if self.paused:
            self.paused = False
            self.protocol.resume_writing()

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return self.unread


@pytest.mark.parametrize(("batching", "expected"), [(0.0, [b"one", b"two"]), (1.0, [b"onetwo"])])
def test_bus_batching_joins_frames_of_separate_loop_turns(batching: float, expected: list[bytes]) -> None:
    """BusBatchingTime: frames written in different loop turns leave in one write (one wake-up of the
    receiving process); without it, each loop turn's frames leave at its end."""
    import asyncio

    from migratory.server.node.bus import Bus, _Outbound

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


def test_a_link_closed_in_the_same_turn_does_not_stop_the_others() -> None:
    """The fault suite's kill-worker round: the agent wrote to a worker's link closed in the same loop turn;
    uvloop raised out of the flush, and every later link's frames stayed unsent, and unscheduled, forever
    (the node's other worker never heard the agent again: /snapshot answered 503 for minutes)."""
    import asyncio

    from migratory.server.node.bus import Bus, _Outbound

    async def scenario() -> tuple[list[bytes], list[bytes]]:
        bus = Bus(0, [1, 2, 3], "test", b"secret", lambda frame, peer: None, lambda peer: None)
        recorders = {}
        for index in (1, 2, 3):
            peer = bus.peers[index]
            peer.up = True
            peer.writer = _Outbound()
            recorders[index] = peer.writer.transport = _Recorder()  # type: ignore[assignment]
        for index in (1, 2, 3):
            assert bus.send_raw(index, b"first")
        recorders[2].closed = True  # killed: its loss not yet handled when the flush runs
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for index in (1, 3):
            assert bus.send_raw(index, b"second")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return recorders[1].writes, recorders[3].writes

    assert asyncio.run(scenario()) == ([b"first", b"second"], [b"first", b"second"])


def _linked(bus: Any, index: int) -> _Recorder:
    from migratory.server.node.bus import _Outbound

    outbound = _Outbound()
    recorder = _Recorder()
    recorder.protocol = outbound
    outbound.transport = recorder  # type: ignore[assignment]
    bus.attach(bus.peers[index], outbound)
    return recorder


def test_a_stream_is_rendered_only_as_the_link_has_room_and_what_follows_it_waits() -> None:
    """A whole state to a starting worker: each frame is rendered when the link can take it, so a slow
    worker costs the sender no copy of it; a frame sent after the stream leaves after all of it."""
    import asyncio

    from migratory.server.node.bus import HIGH_WATER, Bus

    rendered: list[int] = []
    part = b"s" * (HIGH_WATER // 4)

    def stream() -> Iterator[bytes]:
        for n in range(12):
            rendered.append(n)
            yield part

    async def scenario() -> tuple[list[int], list[int], bytes]:
        bus = Bus(0, [1], "test", b"secret", lambda frame, peer: None, lambda peer: None)
        recorder = _linked(bus, 1)
        recorder.unread = HIGH_WATER // 2  # the worker is not reading: half the room is taken already
        assert bus.send_stream(1, stream())
        assert bus.send_raw(1, b"after")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        first = list(rendered)
        await asyncio.sleep(0.01)  # still not reading: no turn renders anything more
        held = list(rendered)
        for _ in range(20):  # it reads everything each time
            recorder.read_all()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return first, held, b"".join(recorder.writes)

    first, held, written = asyncio.run(scenario())
    assert first == [0, 1, 2] and held == first  # what takes the link past HIGH_WATER, and no more
    assert written == part * 12 + b"after"


def test_a_stream_that_fails_relinks_its_peer_and_the_others_go_on() -> None:
    """A bug rendering one worker's state: that link is cut (it starts over with a full state), and the
    frames of every other link in the same flush still leave, now and later."""
    import asyncio

    from migratory.server.node.bus import Bus

    def broken() -> Iterator[bytes]:
        yield b"one"
        raise ValueError("no such subject")

    async def scenario() -> tuple[_Recorder, _Recorder, _Recorder]:
        bus = Bus(0, [1, 2, 3], "test", b"secret", lambda frame, peer: None, lambda peer: None)
        links = {index: _linked(bus, index) for index in (1, 2, 3)}
        assert bus.send_stream(1, broken())
        bus.broadcast_raw(b"all")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        bus.broadcast_raw(b"later")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return links[1], links[2], links[3]

    one, two, three = asyncio.run(scenario())
    assert one.aborted and one.writes == []
    assert two.writes == three.writes == [b"all", b"later"]


def test_a_shared_stream_renders_each_frame_once_and_keeps_only_what_a_reader_still_needs() -> None:
    """fan_out: three readers at different paces each get the whole stream, in order, from one rendering;
    what every reader has passed is let go, and a reader dropped (its link gone) holds nothing back."""
    from migratory.server.node.bus import fan_out

    rendered: list[int] = []

    def source() -> Iterator[bytes]:
        for n in range(5000):
            rendered.append(n)
            yield str(n).encode()

    fast, slow, dropped = fan_out(source(), 3)
    shared = fast._shared  # type: ignore[attr-defined]
    got_fast = [next(fast) for _ in range(3000)]
    got_slow = [next(slow) for _ in range(10)]
    kept = len(shared._chunks)
    assert kept >= 2990  # the slow reader and the dropped one still need them
    del dropped
    got_slow += [next(slow) for _ in range(2990)]
    got_fast += list(fast)
    # at most twice what the slowest reader still needs (checked as the kept part doubles), not all of it
    assert 2000 <= len(shared._chunks) <= 2 * (fast.position - slow.position)  # type: ignore[attr-defined]
    got_slow += list(slow)
    expected = [str(n).encode() for n in range(5000)]
    assert got_fast == got_slow == expected
    assert rendered == list(range(5000))  # once each, for all three


def test_a_stream_shared_by_several_links_is_rendered_once_and_what_follows_it_waits() -> None:
    """A member agent that becomes ready sends its whole state to every worker at once: one rendering for
    all of them (56 renderings cost its agent 7 s at a million clients), each worker at its own pace, and
    a frame sent after the stream reaches each worker after all of it."""
    import asyncio

    from migratory.server.node.bus import HIGH_WATER, Bus

    rendered: list[int] = []
    part = b"s" * (HIGH_WATER // 4)

    def stream() -> Iterator[bytes]:
        for n in range(12):
            rendered.append(n)
            yield part + bytes([n])

    async def scenario() -> dict[int, bytes]:
        bus = Bus(0, [1, 2, 3, 4], "test", b"secret", lambda frame, peer: None, lambda peer: None)
        links = {index: _linked(bus, index) for index in (1, 2, 3)}  # worker 4 is down: it gets nothing
        bus.send_stream_to([1, 2, 3, 4], stream())
        bus.broadcast_raw(b"after")
        for turn in range(40):
            links[1].read_all()  # a fast worker
            if turn % 4 == 0:
                links[2].read_all()  # a slow one; worker 3 reads only at the end
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        for _ in range(20):
            for link in links.values():
                link.read_all()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return {index: b"".join(link.writes) for index, link in links.items()}

    written = asyncio.run(scenario())
    whole = b"".join(part + bytes([n]) for n in range(12)) + b"after"
    assert written == {1: whole, 2: whole, 3: whole}
    assert rendered == list(range(12))


def test_a_shared_stream_that_fails_relinks_every_peer_reading_it() -> None:
    """A bug rendering the shared state fails every worker it was going to, not only the first to read
    on: the others must not take a state cut short for a whole one."""
    import asyncio

    from migratory.server.node.bus import Bus

    def broken() -> Iterator[bytes]:
        yield b"one"
        raise ValueError("no such subject")

    async def scenario() -> dict[int, _Recorder]:
        bus = Bus(0, [1, 2, 3], "test", b"secret", lambda frame, peer: None, lambda peer: None)
        links = {index: _linked(bus, index) for index in (1, 2, 3)}
        bus.send_stream_to([1, 2], broken())
        bus.broadcast_raw(b"all")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return links

    links = asyncio.run(scenario())
    assert links[1].aborted and links[2].aborted
    assert not links[3].aborted and links[3].writes == [b"all"]


def test_a_peer_that_does_not_read_holds_at_most_high_water_in_the_socket_and_loses_nothing() -> None:
    """Over a real Unix socket: 40 MB broadcast to a peer that reads nothing yet; the transport holds
    about HIGH_WATER (the rest waits as the bytes handed over, shared with every other peer), and once
    the peer reads, every frame arrives once, in order."""
    import asyncio
    import socket

    from migratory.server.node.bus import HIGH_WATER, Bus

    frames = [b.Published(f"/s/{n}", bytes(4000), {}, n + 1, 1, True, False, "") for n in range(10_000)]

    async def scenario() -> tuple[int, int, list[b.BusFrame]]:
        loop = asyncio.get_running_loop()
        bus = Bus(0, [1], "flowtest", b"secret", lambda frame, peer: None, lambda peer: None)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(bus.path(1))
        listener.listen(1)
        listener.setblocking(False)
        await bus.start()
        conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 10)
        for _ in range(1000):  # a loaded machine: up to 10 s for the link to come up
            if bus.is_up(1):
                break
            await asyncio.sleep(0.01)
        assert bus.is_up(1), "the bus never linked to the listening peer"
        for frame in frames:
            bus.broadcast(frame)
        await asyncio.sleep(0.2)
        writer = bus.peers[1].writer
        assert writer is not None and writer.transport is not None
        held = writer.transport.get_write_buffer_size()
        waiting = len(bus.peers[1].pending)
        decoder = b.BusDecoder(max_frame=b.MAX_BUS_FRAME)
        got: list[b.BusFrame] = []
        conn.setblocking(False)
        while len(got) < len(frames) + 1:
            data = await asyncio.wait_for(loop.sock_recv(conn, 1 << 20), 10)
            assert data, "the bus closed the link"
            got.extend(decoder.feed(data))
        await bus.close()
        conn.close()
        listener.close()
        return held, waiting, got

    held, waiting, got = asyncio.run(scenario())
    assert held <= HIGH_WATER + 4100
    assert waiting > 9_000  # most of it still waits here, not in the socket's buffer
    assert isinstance(got[0], b.Hello)
    assert got[1:] == frames


def _big_sync(entries: int = 200, size: int = 100) -> b.SyncSubject:
    cached = tuple(Entry(1, i + 1, bytes(size), {}, False, "") for i in range(entries))
    return b.SyncSubject(SubjectSync("/big", 1, entries, Snapshot("/big", bytes(size), {}, entries, 1), cached))


def test_the_preauthentication_limit_applies_to_the_hello_alone() -> None:
    """A link's Hello and the state sync sent right after it often arrive in one read: the Hello is read
    under the 4 KB limit, the rest waits until the caller trusts the peer and raises the limit."""
    hello, sync = b.Hello(1, b"p" * 32), _big_sync()
    stream = b.encode(hello) + b.encode(sync)
    assert len(b.encode(sync)) > b.PREAUTH_MAX_FRAME
    decoder = b.BusDecoder(max_frame=b.PREAUTH_MAX_FRAME)
    decoder.push(stream)
    assert decoder.next_frame() == hello
    with pytest.raises(b.BusError, match="at most 4096"):  # a stranger's second frame is still bounded
        decoder.next_frame()
    decoder.max_frame = b.MAX_BUS_FRAME
    assert decoder.feed(b"") == [sync]
    split = b.BusDecoder(max_frame=b.PREAUTH_MAX_FRAME)
    split.push(stream[:3])
    assert split.next_frame() is None  # not even a length yet
    split.push(stream[3:10])
    assert split.next_frame() is None


def test_the_bus_accepts_a_hello_and_a_large_state_in_one_read() -> None:
    """The worker-agent link of a member restarted after traffic (the fault checker's 13,768-byte frame)."""
    import asyncio

    from migratory.server.node.bus import Bus, _Inbound, proof

    async def scenario() -> tuple[list[b.BusFrame], int]:
        got: list[b.BusFrame] = []
        bus = Bus(0, [1], "test", b"secret", lambda frame, peer: got.append(frame), lambda peer: None)
        inbound = _Inbound(bus)
        inbound.transport = _Recorder()  # type: ignore[assignment]
        sync = _big_sync()
        inbound.data_received(b.encode(b.Hello(1, proof(b"secret", "test", 1))) + b.encode(sync) + b"\x00\x00")
        inbound.data_received(b.encode(b.Interest("/big", 2))[2:])
        return got, bus.refused

    got, refused = asyncio.run(scenario())
    assert refused == 0
    assert got == [_big_sync(), b.Interest("/big", 2)]


def test_a_stranger_still_cannot_make_the_bus_buffer_a_large_frame() -> None:
    import asyncio

    from migratory.server.node.bus import Bus, _Inbound

    async def scenario() -> tuple[int, bool]:
        bus = Bus(0, [1], "test", b"secret", lambda frame, peer: None, lambda peer: None)
        inbound = _Inbound(bus)
        recorder = _Recorder()
        inbound.transport = recorder  # type: ignore[assignment]
        inbound.data_received(b.encode(_big_sync()))
        return bus.refused, recorder.aborted

    assert asyncio.run(scenario()) == (1, True)


def test_a_full_cache_is_synchronised_in_bounded_frames() -> None:
    state = _big_sync(entries=3000, size=1000).state
    frames = list(b.sync_frames(state, fence=9))
    assert len(frames) >= 3
    assert all(len(b.encode(f)) < b.SYNC_CHUNK_BYTES + 4096 for f in frames)
    assert [f.more for f in frames] == [True] * (len(frames) - 1) + [False]
    assert {f.fence for f in frames} == {9}
    assert tuple(e for f in frames for e in f.state.entries) == state.entries


@pytest.mark.parametrize("retained", [True, False])
def test_a_worker_resyncs_its_subscribers_when_a_live_message_skips_ahead(retained: bool) -> None:
    """The fault suite's Standard partition round: a subscriber saw seq 41 then 56 with no NOTIFY_DATA_RESYNC
    (its member had adopted the other side's history and the next live message skipped ahead)."""
    import asyncio

    from migratory.config import Config
    from migratory.server.engine.core import Engine

    async def scenario() -> list[tuple[str, int]]:
        engine = Engine(Config.from_text("Listen = 127.0.0.1:0\n", "t.conf"), 1, asyncio.get_running_loop())
        seen: list[tuple[str, int]] = []
        engine.resync = lambda subject: seen.append(("resync", 0))  # type: ignore[method-assign]

        def deliver(subject: str, entry: Entry, guaranteed: bool) -> tuple[int, int]:
            seen.append(("deliver", entry.seq))
            return 0, 0

        engine.deliver = deliver  # type: ignore[method-assign]
        for seq in (1, 2, 5):
            engine.on_bus_frame(b.Published("/gap", b"v", {}, seq, 1, retained, False), 1)
        return seen

    expected = [("deliver", 1), ("deliver", 2), ("resync", 0)] + ([] if retained else [("deliver", 5)])
    assert asyncio.run(scenario()) == expected


_TEXT = st.text(max_size=6)
_ENTRIES = st.lists(
    st.builds(
        Entry,
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.binary(max_size=20),
        st.dictionaries(_TEXT, _TEXT, max_size=3),
        st.booleans(),
        _TEXT,
    ),
    max_size=6,
)


@settings(max_examples=300)
@given(_ENTRIES, st.data())
def test_a_states_cached_messages_decode_in_place_and_any_cut_or_flip_is_a_bus_error(
    entries: list[Entry], data: st.DataObject
) -> None:
    """The cached messages of a state are read in place (bus.py _Cursor.entries): every state round-trips,
    every truncation of it is a BusError, and any byte changed is a BusError or a frame that round-trips."""
    ids = tuple((e.publish_id, e.epoch, e.seq) for e in entries[:2])
    frame = b.SyncSubject(SubjectSync("/s/é", 3, 9, None, tuple(entries), ids), more=data.draw(st.booleans()), fence=4)
    body = b.encode(frame)[4:]
    assert b.decode(body) == frame
    cut = data.draw(st.integers(2, len(body) - 1))
    with pytest.raises(b.BusError):
        b.decode(body[:cut])
    at = data.draw(st.integers(2, len(body) - 1))
    flipped = body[:at] + bytes((body[at] ^ data.draw(st.integers(1, 255)),)) + body[at + 1 :]
    try:
        changed = b.decode(flipped)
    except b.BusError:
        return
    assert b.decode(b.encode(changed)[4:]) == changed


# The bytes of the frames every publication carries, as the cursor-based codec wrote them before they were
# read and written in place: members of two versions meet on the links during a rolling upgrade.
WIRE = [
    (
        b.Published("/a/b", b"c", {"k": "v"}, 5, 6, False, True, "p"),
        "000000320402000000042f612f6200000001000000016b00000001760000000000000005000000000000000600000001700000000163",
    ),
    (
        b.Forward(7, "/a/é", b"xy", {"k": "v"}, True, True, {"o": "w"}, "pid", 2),
        "0000003d0203000000000000000702000000052f612fc3a900000001000000016b000000017600000001000000016f0000"
        "00017700000003706964000000027879",
    ),
    (
        b.ForwardStatus(9, 3, 12, "why", 65, 4),
        "0000002903030000000000000009000000000000000c0000000000000041000000000000000400000003776879",
    ),
    (b.Ack("/a/b", 65, 17), "0000001a0e0000000000000000410000000000000011000000042f612f62"),
]


@pytest.mark.parametrize(("frame", "wire"), WIRE, ids=lambda x: type(x).__name__)
def test_the_publication_frames_keep_their_bytes_on_the_wire(frame: b.BusFrame, wire: str) -> None:
    assert b.encode(frame).hex() == wire
    assert b.decode(bytes.fromhex(wire)[4:]) == frame


_HOT = st.one_of(
    st.builds(b.Published, _TEXT, st.binary(max_size=40), st.dictionaries(_TEXT, _TEXT, max_size=3),
              st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.booleans(), st.booleans(), _TEXT),
    st.builds(b.Forward, st.integers(0, 2**64 - 1), _TEXT, st.binary(max_size=40),
              st.dictionaries(_TEXT, _TEXT, max_size=3), st.booleans(), st.booleans(),
              st.dictionaries(_TEXT, _TEXT, max_size=3), _TEXT, st.integers(0, 255)),
    st.builds(b.ForwardStatus, st.integers(0, 2**64 - 1), st.integers(0, 255), st.integers(0, 2**64 - 1), _TEXT,
              st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    st.builds(b.Ack, _TEXT, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
)  # fmt: skip


@settings(max_examples=400)
@given(_HOT, st.data())
def test_the_publication_frames_read_in_place_refuse_any_cut_and_survive_any_flip(
    frame: b.BusFrame, data: st.DataObject
) -> None:
    """Published, Forward, ForwardStatus and Ack are read without a cursor (bus.py _IN_PLACE): each round-trips,
    every truncation is a BusError, and a changed byte is a BusError or a frame that round-trips."""
    body = b.encode(frame)[4:]
    assert b.decode(body) == frame
    cut = data.draw(st.integers(2, len(body) - 1))
    with pytest.raises(b.BusError):
        b.decode(body[:cut])
    at = data.draw(st.integers(2, len(body) - 1))
    flipped = body[:at] + bytes((body[at] ^ data.draw(st.integers(1, 255)),)) + body[at + 1 :]
    try:
        changed = b.decode(flipped)
    except b.BusError:
        return
    assert b.decode(b.encode(changed)[4:]) == changed

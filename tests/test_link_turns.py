"""A member link hands a peer's frames on at most FRAMES_PER_TURN a loop turn (migratory/server/cluster/links.py).

A rejoining member receives its peers' whole state at once; handed on in one turn it held the agent
for seconds on a saturated host, its heartbeats went out late and the peers dropped the link. Here
a link gets 1,000 frames in one read: the loop must turn (a timer runs) between batches, reading
must pause while frames wait and resume after, and every frame must arrive once, in order.
"""

from __future__ import annotations

import asyncio
from typing import Any

from migratory import bus as b
from migratory.server.cluster import links


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.pauses = 0
        self.aborted = False

    def pause_reading(self) -> None:
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def write(self, data: Any) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True


class _Links:
    def __init__(self, log: list[Any]) -> None:
        self.log = log
        self.me, self.incarnation = 0, 1

    def received(self, member: int, frame: b.BusFrame) -> None:
        self.log.append(frame)


def _fed(data: bytes, log: list[Any]) -> _Transport:
    """An authenticated link on a fake transport, given ``data`` in one read while a callback logs "tick"
    at every loop turn; returns once 20 turns have passed (what the link handed on is in ``log``)."""

    async def main() -> _Transport:
        link = links._Link(_Links(log), expected=1)  # type: ignore[arg-type]
        transport = _Transport()
        link.transport = transport
        link.up, link.peer = True, 1
        link.decoder.max_frame = b.MAX_BUS_FRAME
        ticks = [0]

        def tick() -> None:
            log.append("tick")
            ticks[0] += 1
            if ticks[0] < 50:
                asyncio.get_running_loop().call_soon(tick)

        asyncio.get_running_loop().call_soon(tick)
        link.data_received(data)
        await asyncio.sleep(0)  # the reads of this turn are in: one budget for all of them
        assert not transport.reading  # frames wait: no more is read meanwhile
        for _ in range(20):
            await asyncio.sleep(0)
        return transport

    return asyncio.run(main())


def _runs(log: list[Any]) -> list[int]:
    """How many frames were handed on between two loop turns, turn after turn."""
    runs, run = [], 0
    for x in log:
        if x == "tick":
            runs.append(run)
            run = 0
        else:
            run += 1
    return [*runs, run]


def test_a_peers_burst_is_handed_on_in_turns_in_order_and_reading_resumes() -> None:
    log: list[Any] = []
    frames = [b.Interest(f"/s/{i}", i + 1) for i in range(1000)]
    transport = _fed(b"".join(b.encode(f) for f in frames), log)
    handed = [x for x in log if x != "tick"]
    assert [f.count for f in handed] == list(range(1, len(frames) + 1))  # every frame once, in order
    assert transport.reading and transport.pauses >= 1
    # the loop turned between batches: ticks interleave with the frames, none more than a batch apart
    runs = _runs(log)
    assert max(runs) <= links.FRAMES_PER_TURN, runs
    assert sum(1 for r in runs if r) >= len(frames) // links.FRAMES_PER_TURN


def test_large_frames_are_decoded_and_handed_on_about_bytes_per_turn_at_a_time() -> None:
    """A state's frames are up to 1 MB of cache each: 256 of them in a turn (decoded as they were read,
    merged, relayed to every worker) held the agent for seconds. Bodies wait undecoded, and a turn
    decodes and hands on about BYTES_PER_TURN of them; a corrupt one ends the link after those before it."""
    log: list[Any] = []
    big = [b.Published(f"/s/{i}", bytes(100_000), {}, i + 1, 1, False, True, "") for i in range(12)]
    transport = _fed(b"".join(b.encode(f) for f in big) + b"\x00\x00\x00\x02\xff\x00", log)
    handed = [x.subject for x in log if x != "tick"]
    assert handed == [f"/s/{i}" for i in range(12)]  # every good frame once, in order, before the corrupt one
    assert max(_runs(log)) <= links.BYTES_PER_TURN // 100_000 + 1, _runs(log)
    assert transport.pauses >= 1 and transport.aborted  # the corrupt frame, decoded last, ended the link


def _link_on_socket(loop: asyncio.AbstractEventLoop) -> tuple[links._Link, Any]:
    """A link, authenticated, over one end of a socket pair; the MemberLinks around it only flushes."""
    import socket

    member_links = links.MemberLinks.__new__(links.MemberLinks)
    member_links._dirty, member_links._armed, member_links._closed = [], False, True
    ours, theirs = socket.socketpair()
    link = links._Link(member_links, expected=1)
    link.up, link.peer = True, 1
    member_links.links = {1: link}
    return link, (ours, theirs)


def test_a_whole_state_is_encoded_as_the_peer_reads_it_and_what_follows_comes_after() -> None:
    """A Guaranteed member's full cache sent to a rejoining peer was encoded in one turn and written at
    once: seconds of CPU past the peers' heartbeat timeout, and a state larger than MAX_BACKLOG dropped
    the very link it was sent on, at every rejoin. Here 8 MB of state over a link whose MAX_BACKLOG is
    2 MB: the link holds, at most about HIGH_WATER unread at any time, frames encoded only as it empties,
    and a frame sent after the stream arrives after all of it."""

    async def main() -> tuple[list[b.BusFrame], int, int, bool]:
        loop = asyncio.get_running_loop()
        link, (ours, theirs) = _link_on_socket(loop)
        await loop.create_connection(lambda: link, sock=ours)
        assert link.transport is not None
        transport = link.transport
        encoded = [0]
        content = bytes(20_000)

        def state() -> Any:
            for i in range(400):
                encoded[0] += 1
                yield b.Published(f"/s/{i}", content, {}, i + 1, 1, False, True, "")

        link.links.send_stream(1, state())
        link.links.send(1, b.Interest("/after", 1))
        await asyncio.sleep(0)
        first_turn = encoded[0]
        reader, _ = await asyncio.open_connection(sock=theirs)
        decoder = b.BusDecoder()
        frames: list[b.BusFrame] = []
        most = 0
        while len(frames) < 401:
            most = max(most, transport.get_write_buffer_size())
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, "the link was closed"
            frames.extend(decoder.feed(data))
        return frames, first_turn, most, transport.is_closing()

    with _max_backlog(2 << 20):
        frames, first_turn, most, closing = asyncio.run(main())
    assert not closing
    assert first_turn < 100  # encoded as the link empties, not all at once
    assert most <= links.HIGH_WATER + 64 * 1024
    assert [f.subject for f in frames] == [f"/s/{i}" for i in range(400)] + ["/after"]  # type: ignore[union-attr]


def test_a_peer_that_stops_reading_is_still_dropped_past_max_backlog_behind_a_state() -> None:
    """The stream waits for room, and the frames sent after it wait behind it: those count, and a peer
    that never reads is dropped once they pass MAX_BACKLOG, as before (a hung member cannot grow our memory)."""

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        link, (ours, theirs) = _link_on_socket(loop)
        await loop.create_connection(lambda: link, sock=ours)
        transport = link.transport
        assert transport is not None
        link.queue(b.encode(b.Interest(f"/s/{i}", 1)) for i in range(10**9))  # never ends: the peer never reads
        for i in range(400):
            link.queue(b.encode(b.Published(f"/live/{i}", bytes(10_000), {}, i + 1, 1, False, True, "")))
            await asyncio.sleep(0)
            if transport.is_closing():
                break
        theirs.close()
        return transport.is_closing()

    with _max_backlog(2 << 20):
        assert asyncio.run(main())


class _max_backlog:
    def __init__(self, value: int) -> None:
        self.value = value

    def __enter__(self) -> None:
        self.saved, links.MAX_BACKLOG = links.MAX_BACKLOG, self.value

    def __exit__(self, *exc: object) -> None:
        links.MAX_BACKLOG = self.saved

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


class _Links:
    def __init__(self, log: list[Any]) -> None:
        self.log = log
        self.me, self.incarnation = 0, 1

    def received(self, member: int, frame: b.BusFrame) -> None:
        self.log.append(frame)


def test_a_peers_burst_is_handed_on_in_turns_in_order_and_reading_resumes() -> None:
    async def main() -> tuple[list[Any], _Transport, int]:
        log: list[Any] = []
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

        frames = [b.Interest(f"/s/{i}", i + 1) for i in range(1000)]
        asyncio.get_running_loop().call_soon(tick)
        link.data_received(b"".join(b.encode(f) for f in frames))
        assert not transport.reading  # frames wait: no more is read meanwhile
        for _ in range(20):
            await asyncio.sleep(0)
        return log, transport, len(frames)

    log, transport, count = asyncio.run(main())
    handed = [x for x in log if x != "tick"]
    assert [f.count for f in handed] == list(range(1, count + 1))  # every frame once, in order
    assert transport.reading and transport.pauses >= 1
    # the loop turned between batches: ticks interleave with the frames, none more than a batch apart
    runs, run = [], 0
    for x in log:
        if x == "tick":
            runs.append(run)
            run = 0
        else:
            run += 1
    runs.append(run)
    assert max(runs) <= links.FRAMES_PER_TURN, runs
    assert sum(1 for r in runs if r) >= count // links.FRAMES_PER_TURN

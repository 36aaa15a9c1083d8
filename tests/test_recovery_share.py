"""Recovery reads shared in a reconnect storm (issue 51 item 2): the clients asking one subject from one position
in one loop turn get frames built once, and nothing stale once the subject moves on."""

from __future__ import annotations

import asyncio

from migratory import bus as b
from migratory import protocol as p
from migratory.config import Config
from migratory.server.engine.core import Engine


def _decoded(frames: object) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for frame in frames:  # type: ignore[attr-defined]
        length = frame[1] & 0x7F  # a server's frame: unmasked, the header then the payload
        message = p.decode_server(frame[2 + {126: 2, 127: 8}.get(length, 0) :])
        out.append((type(message).__name__, getattr(message, "seq", getattr(message, "code", None))))
    return out


def test_one_turns_recoveries_of_a_subject_are_built_once_and_follow_new_messages() -> None:
    async def scenario() -> None:
        engine = Engine(Config.from_text("Listen = 127.0.0.1:0\n", "t.conf"), 1, asyncio.get_running_loop())
        engine.replica.cache_size = 100  # as a Guaranteed member's replica caches every subject
        engine.deliver = lambda subject, entry, guaranteed: (0, 0)  # type: ignore[method-assign]
        for seq in (1, 2, 3, 4):
            engine.on_bus_frame(b.Published("/storm", f"v{seq}".encode(), {}, seq, 1, True, True), 1)
        first = engine.initial_frames(2, "/storm", (1, 2))
        assert [kind for kind, _ in _decoded(first)] == ["Delivery", "Delivery", "Notify"]
        assert [seq for _, seq in _decoded(first)[:2]] == [3, 4]
        for _ in range(99):  # the rest of the storm's clients of this subject, in the same turn
            assert engine.initial_frames(2, "/storm", (1, 2)) is first
        assert engine.stats.recoveries_shared == 99
        assert engine.stats.messages_recovered == 200  # each client's recovered messages still count
        other = engine.initial_frames(2, "/storm", (1, 3))  # another position: its own read
        assert [seq for _, seq in _decoded(other)[:1]] == [4] and other is not first
        engine.on_bus_frame(b.Published("/storm", b"v5", {}, 5, 1, True, True), 1)  # the subject moves on
        moved = engine.initial_frames(2, "/storm", (1, 2))
        assert [seq for _, seq in _decoded(moved)[:3]] == [3, 4, 5]
        await asyncio.sleep(0)  # next turn: built again
        await asyncio.sleep(0)
        again = engine.initial_frames(2, "/storm", (1, 2))
        assert again is not moved and again == moved
        snapshot = engine.initial_frames(2, "/storm", None)
        assert _decoded(snapshot) and engine.initial_frames(2, "/storm", None) is snapshot

    asyncio.run(scenario())

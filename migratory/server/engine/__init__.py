"""One worker's publish/subscribe engine: :class:`.core.Engine` ties together admission
(:mod:`.admission`), the HTTP stream registry (:mod:`.streams`), the timer wheel
(:mod:`.timers`), the fan-out and its one-write-per-turn flush (:mod:`.fanout`) and the
publications waiting for their coordinator (:mod:`.forwards`).

May import the core, :mod:`migratory.server.node` (the bus) and the standard library. A
connection is known only through the protocols of :mod:`.types` (``Client``, ``Publisher``):
never the sessions, the cluster or the processes.
"""

"""What the processes of one node share: the node bus between workers and the member agent
(:mod:`.bus`), the counters in shared memory (:mod:`.counters`), scheduling priorities
(:mod:`.priority`) and event-loop stall reports (:mod:`.pauses`).

May import the core and :mod:`migratory.server.transport` (the counters name the TLS layer's);
nothing of the engine, the sessions, the cluster or the processes.
"""

"""The member agent (:mod:`.agent`): one process per member that links to the other members'
agents (:mod:`.links`) and, on a seed, runs the seeds' Raft (:mod:`.consensus`), feeding the
sans-I/O :class:`migratory.member.Member`.

May import the core and :mod:`migratory.server.node` (the bus to the workers, the counters);
not the engine or the sessions: the agent never sees a client.
"""

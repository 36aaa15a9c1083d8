"""What a client speaks over a connection: :mod:`.connection` (the HTTP/WebSocket connection a
transport feeds), :mod:`.native` (the native protocol's session), :mod:`.httpapi` (HTTP
streaming and the HTTP API). A second session protocol (MQTT) goes here.

May import the core, the engine and :mod:`migratory.server.node`; not the cluster or the processes.
"""

"""What a client speaks over a connection: :mod:`.connection` (the HTTP/WebSocket connection a
transport feeds), :mod:`.native` (the native protocol's session), :mod:`.httpapi` (HTTP
streaming and the HTTP API), :mod:`.mqtt` (MQTT 3.1.1 and 5.0 over TCP, TLS and WebSocket) and
:mod:`.mqttstore` (MQTT sessions kept as records in the replica); :mod:`.base` is what every client
connection shares (peer, admission, output).

May import the core, the engine and :mod:`migratory.server.node`; not the cluster or the processes.
"""

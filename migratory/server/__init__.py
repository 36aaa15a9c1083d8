"""The server: the asyncio side of the node, around the sans-I/O core in :mod:`migratory`.

One folder per concern, each allowed to import only the rooms below it (the contracts in
pyproject.toml, checked by ``make lint`` with import-linter):

- :mod:`.process`: the node's processes: listeners, the supervisor, workers, signals, the
  monitor listener. The top: it wires everything below together.
- :mod:`.cluster`: the member agent, its links to the other members, the seeds' consensus.
- :mod:`.sessions`: what a client speaks over a connection: the WebSocket/HTTP connection,
  the native session, HTTP streaming and the HTTP API (MQTT goes here).
- :mod:`.engine`: one worker's publish/subscribe engine: subscribe, publish, fan-out,
  timers, streams, admission. It knows clients only as :class:`.engine.types.Client`.
- :mod:`.node`: what the processes of one node share: the node bus, the counters in shared
  memory, scheduling priorities, stall reports.
- :mod:`.transport`: bytes in and out of client sockets: the raw epoll transport, the TLS
  record layer and its C sealer, the TLS context. Nothing about sessions.

``cluster`` and ``sessions`` do not import each other; the core (``migratory.*`` outside
this package) never imports anything here.
"""

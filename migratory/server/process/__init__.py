"""The node's processes (:mod:`.app`: listeners, the supervisor, the workers, signals, privileges)
and the monitor listener (:mod:`.monitor`: /health, /metrics, /cluster, the dashboard).

The top of the server: may import every other package of it; nothing imports it but the CLI.
"""

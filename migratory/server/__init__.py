"""The asyncio adapters: listeners, connections, timers, HTTP endpoints."""

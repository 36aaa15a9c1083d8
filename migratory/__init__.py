"""MigratoryData-class real-time publish/subscribe server and its Python client.

The package is split the way ``websockets`` and ``h11`` are: modules at this level
are the sans-I/O core (no asyncio), ``migratory.server`` holds the asyncio adapters,
``migratory.client`` is the asyncio client library.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"

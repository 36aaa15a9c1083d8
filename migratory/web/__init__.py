"""The pages and the JavaScript client the server hands to browsers (no CDN, nothing fetched elsewhere).

``/migratory.js`` is clients/js/migratory.js (the same file, linked here so the
package carries it); ``/demo`` is the demo page of the client listeners;
``/dashboard`` the live page of the monitor listener (migratory/server/process/monitor.py).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from migratory.http import response

__all__ = ["CROSS_ORIGIN", "DASHBOARD", "PAGES", "asset", "page"]

PAGES = {
    "/migratory.js": ("migratory.js", "text/javascript; charset=utf-8"),
    "/demo": ("demo.html", "text/html; charset=utf-8"),
}
CROSS_ORIGIN = frozenset({"/migratory.js"})  # meant to be loaded by pages of other origins (docs/clients.md)
DASHBOARD = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/migratory.js": ("migratory.js", "text/javascript; charset=utf-8"),
}


@cache
def asset(name: str) -> bytes:
    """A file of this package (read once)."""
    return resources.files(__name__).joinpath(name).read_bytes()


def page(
    path: str, head: bool = False, keep_alive: bool = True, table: dict[str, tuple[str, str]] = PAGES
) -> tuple[int, bytes]:
    name, content_type = table[path]
    body = asset(name)
    extra = {"X-Content-Type-Options": "nosniff"}
    if path in CROSS_ORIGIN:  # a page on another origin imports the client (`import()` fetches in CORS mode)
        extra["Access-Control-Allow-Origin"] = "*"
    response_bytes = response(
        200, b"" if head else body, content_type, keep_alive=keep_alive, extra=extra, cache="no-cache"
    )
    return 200, response_bytes

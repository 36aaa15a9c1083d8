"""Real browsers: the demo page and the JavaScript client in headless Chromium (Debian's), driven by Playwright.

No browser is downloaded: Playwright launches /usr/bin/chromium. The fallback case puts
a proxy that refuses WebSocket upgrades between the browser and the server, the way a
proxy that strips ``Upgrade`` does, and checks that the page gets its data over HTTP
streaming instead. Screenshots are kept in test-artifacts/.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest

from migratory.client import MigratoryClient
from migratory.protocol import Status
from tests.conftest import ServerProcess, free_port, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/deps.sh installs it)"),
]

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield chromium
        chromium.close()


def in_thread(coroutine: Callable[[], Any]) -> Any:
    """Run a coroutine in a thread of its own (Playwright's sync API holds this thread's event loop)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(asyncio.wait_for(coroutine(), 60))))
    thread.start()
    thread.join(90)
    assert result, "the coroutine did not finish"
    return result[0]


def publish(url: str, subject: str, content: str, token: str = "", **fields: str) -> Status:
    async def go() -> Status:
        async with MigratoryClient([url], token=token) as client:
            return await client.publish(subject, content, fields=fields)

    status = in_thread(go)
    assert isinstance(status, Status)
    return status


def cell(page: Any, name: str, column: str) -> str:
    return str(page.text_content(f"#row-{name} .{column}") or "")


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_demo_page_shows_snapshots_then_updates_and_publishes(
    browser: Any, server_factory: Callable[..., ServerProcess]
) -> None:
    server = server_factory({"Workers": "2"})
    assert publish(server.ws_url, "/demo/stocks/IBM", "193.10", volume="6.62M") is Status.NO_SUBSCRIBER
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server.http_url}/demo")
    page.wait_for_selector("#status.up", timeout=20000)
    assert page.text_content("#transport") == "websocket"
    wait_for(lambda: cell(page, "IBM", "value") == "193.10", what="the snapshot")
    assert cell(page, "IBM", "type") == "SNAPSHOT" and "volume=6.62M" in cell(page, "IBM", "fields")
    assert publish(server.ws_url, "/demo/stocks/IBM", "194.00", ask="194.1") is Status.OK
    wait_for(lambda: cell(page, "IBM", "value") == "194.00", what="an update")
    assert cell(page, "IBM", "type") == "UPDATE"
    assert cell(page, "IBM", "fields") == "ask=194.1"  # an update carries its own fields; the snapshot, the union
    page.select_option("#subject", "/demo/stocks/AAPL")
    page.fill("#value", "227.55")
    page.fill("#fields", "bid=227.5 ask=227.6")
    page.click("button[type=submit]")
    wait_for(lambda: cell(page, "AAPL", "value") == "227.55", what="the page's own publication")
    assert "OK" in (page.text_content("#result") or "")
    page.click("#tick")  # data moves by itself
    before = cell(page, "MSFT", "seq") + cell(page, "GOOG", "seq") + cell(page, "IBM", "seq")
    wait_for(lambda: cell(page, "MSFT", "seq") + cell(page, "GOOG", "seq") + cell(page, "IBM", "seq") != before)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo.png"))
    assert not errors, errors
    page.close()


def test_a_test_page_with_entitlement_and_a_server_restart(browser: Any, tmp_path: Path) -> None:
    secret = "browser-test-secret-0123456789abcdef"
    extra = {"Entitlement": "JWT", "EntitlementJwtSecret": secret}
    server = start_server(tmp_path / "srv", extra)
    try:
        token = jwt.encode(
            {"permissions": {"sub": ["/demo/stocks/IBM", "/demo/stocks/AAPL"], "pub": ["/demo/**"]}}, secret, "HS256"
        )
        page = browser.new_page()
        page.goto(f"{server.http_url}/demo?token={token}")
        page.wait_for_selector("#status.up", timeout=20000)
        wait_for(lambda: "/demo/stocks/MSFT: DENIED" in (page.text_content("#log") or ""), what="a denied subscribe")
        assert "SUBSCRIBE_DENY /demo/stocks/GOOG" in (page.text_content("#log") or "")
        assert publish(server.ws_url, "/demo/stocks/IBM", "1", token=token) is Status.OK
        wait_for(lambda: cell(page, "IBM", "value") == "1", what="an allowed subject's update")
        # the server restarts: the page reconnects and subscribes again by itself
        port = server.port
        assert server.stop() == 0
        wait_for(lambda: "down" in (page.text_content("#status") or ""), what="NOTIFY_SERVER_DOWN")
        server = start_server(tmp_path / "srv", extra, port=port)
        page.wait_for_selector("#status.up", timeout=30000)
        wait_for(
            lambda: publish(server.ws_url, "/demo/stocks/IBM", "2", token=token) is Status.OK, what="the resubscription"
        )
        wait_for(lambda: cell(page, "IBM", "value") == "2", what="an update after the restart")
        page.close()
    finally:
        server.stop()


class UpgradeStrippingProxy:
    """A TCP proxy that forwards HTTP but refuses every WebSocket upgrade (403), like some proxies do."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.refused = 0
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(65536)
            if not chunk:
                client.close()
                return
            head += chunk
        if b"upgrade: websocket" in head.lower():
            self.refused += 1
            client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            client.close()
            return
        upstream = socket.create_connection(self.target)
        upstream.sendall(head)

        def pipe(source: socket.socket, sink: socket.socket) -> None:
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
            except OSError:
                pass
            finally:
                for s in (source, sink):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)

    def close(self) -> None:
        self.listener.close()


def test_the_fallback_is_taken_when_websocket_is_blocked(
    browser: Any, server_factory: Callable[..., ServerProcess]
) -> None:
    server = server_factory({"Workers": "2"})
    proxy = UpgradeStrippingProxy((server.host, server.port))
    try:
        publish(server.ws_url, "/demo/stocks/GOOG", "171.80")
        page = browser.new_page()
        page.goto(f"http://127.0.0.1:{proxy.port}/demo")
        page.wait_for_selector("#status.up", timeout=30000)
        assert page.text_content("#transport") == "http-stream"
        assert proxy.refused >= 1
        wait_for(lambda: cell(page, "GOOG", "value") == "171.80", what="the snapshot over HTTP streaming")
        assert publish(server.ws_url, "/demo/stocks/GOOG", "172.00") is Status.OK
        wait_for(lambda: cell(page, "GOOG", "value") == "172.00", what="an update over HTTP streaming")
        page.fill("#value", "193.99")
        page.click("button[type=submit]")  # its publications go as POSTs, through the proxy too
        wait_for(lambda: cell(page, "IBM", "value") == "193.99", what="a publication over HTTP streaming")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "demo-http-stream.png"))
        page.close()
    finally:
        proxy.close()


def test_the_dashboard_shows_live_numbers(browser: Any, server_factory: Callable[..., ServerProcess]) -> None:
    monitor = free_port()
    server = server_factory({"Workers": "2", "MonitorHTTP.Listen": f"127.0.0.1:{monitor}", "MonitorPushInterval": "1"})
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"http://127.0.0.1:{monitor}/dashboard")
    page.wait_for_selector("#status.up", timeout=20000)

    async def traffic() -> None:
        clients = [MigratoryClient([server.ws_url]) for _ in range(5)]
        for client in clients:
            await client.connect()
            await client.subscribe(["/dash/x"])
        for n in range(40):
            await clients[0].publish("/dash/x", f"{n}".encode())
            await asyncio.sleep(0.05)
        await asyncio.sleep(3)
        for client in clients:
            await client.close()

    thread = threading.Thread(target=lambda: asyncio.run(traffic()))
    thread.start()
    seen: set[str] = set()

    def moving() -> bool:
        seen.add(str(page.text_content("#v-messages_out_per_second")))
        return (
            len(seen - {"\u2013", "0"}) >= 1
        )  # an en dash until the first document and int(page.text_content("#v-connected_clients") or "0") >= 5

    wait_for(moving, timeout=30, what="live numbers on the dashboard")
    thread.join(60)
    page.wait_for_function("document.querySelectorAll('#windows tbody tr').length === 7", timeout=20000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    assert not errors, errors
    page.close()


def test_a_page_of_another_origin_imports_the_client_from_the_server(
    browser: Any, server_factory: Callable[..., ServerProcess]
) -> None:
    """docs/clients.md: a web app on its own origin loads the client from the push server. Chromium fetches a
    module with ``import()`` in CORS mode: without ``Access-Control-Allow-Origin`` on /migratory.js it fails."""
    import http.server

    server = server_factory({})
    assert publish(server.ws_url, "/cors/x", "from-the-server") is Status.NO_SUBSCRIBER
    page_html = f"""<!doctype html><meta charset="utf-8"><title>app</title><pre id="out"></pre><script type="module">
const out = document.getElementById("out");
try {{
  const m = await import("{server.http_url}/migratory.js");
  const client = new m.MigratoryClient(["{server.ws_url}"], {{
    onMessage: (msg) => {{ out.textContent += msg.type + " " + msg.text + "\\n"; }},
  }});
  await client.connect();
  await client.subscribe(["/cors/x"]);
}} catch (e) {{ out.textContent += "ERROR " + e; }}
</script>""".encode()

    class App(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page_html)))
            self.end_headers()
            self.wfile.write(page_html)

        def log_message(self, *args: Any) -> None:
            pass

    app = http.server.ThreadingHTTPServer(("127.0.0.3", 0), App)  # another host and port: another origin
    threading.Thread(target=app.serve_forever, daemon=True).start()
    try:
        page = browser.new_page()
        page.goto(f"http://127.0.0.3:{app.server_address[1]}/")
        wait_for(lambda: "SNAPSHOT from-the-server" in (page.text_content("#out") or ""), what="the snapshot")
        assert "ERROR" not in (page.text_content("#out") or "")
        page.close()
    finally:
        app.shutdown()
        app.server_close()


def test_the_dashboard_shows_the_last_hour_and_every_member(browser: Any, tmp_path: Path) -> None:
    """Issue 34: the dashboard of any member opens with the history the node keeps already drawn, one chart per
    indicator, and shows every member of the cluster with its link, the quorum, the leader and the term."""
    from migratory.bench.cluster import LocalCluster

    with LocalCluster(tmp_path, 3, mode="Guaranteed") as cluster:
        cluster.start_all()
        for index in range(3):
            cluster.wait_view(index, {0, 1, 2})

        async def traffic() -> None:
            async with MigratoryClient([cluster.members[1].ws_url]) as client:  # the node whose page we open
                await client.subscribe(["/dash/h"])
                for n in range(30):
                    await client.publish("/dash/h", f"{n}".encode())
                    await asyncio.sleep(0.1)

        in_thread(traffic)
        time.sleep(2)  # a few seconds of history sampled
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{cluster.members[1].monitor_url}/dashboard")
        page.wait_for_selector("body[data-history=drawn]", timeout=20000)
        charts = page.eval_on_selector_all("canvas", "cs => cs.map(c => [c.id, Number(c.dataset.points || 0)])")
        assert len(charts) == 7, charts  # the seven indicators
        assert all(points >= 5 for _, points in charts), charts  # drawn from the node's history, not from scratch
        peak = float(page.get_attribute("#c-messages_in_per_second", "data-peak") or 0)
        assert peak >= 3, peak  # the traffic of a few seconds ago (10 publications a second) is on it
        page.wait_for_selector("#member-2", timeout=20000)
        rows = {
            i: str(page.text_content(f"#member-{i}") or "") for i in range(3) if page.query_selector(f"#member-{i}")
        }
        assert set(rows) == {0, 1, 2}, rows
        assert "this member" in rows[1] and "up" in rows[0] and "up" in rows[2], rows
        summary = str(page.text_content("#cluster-summary") or "")
        assert "quorum yes" in summary and "leader member" in summary and "term" in summary, summary
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-cluster.png"), full_page=True)
        assert not errors, errors
        page.close()

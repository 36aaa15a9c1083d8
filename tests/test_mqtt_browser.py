"""MQTT over WebSocket with a client nobody here wrote: MQTT.js in headless Chromium (Debian's), driven by Playwright.

MQTT.js (the npm package ``mqtt``, major version 5) is fetched once per test session with ``npm pack mqtt@5``
into a temporary folder, and its browser bundle (``dist/mqtt.min.js``) is served to the page with the page's
helpers (tests/mqtt_browser_support.js) by a small HTTP server on 127.0.0.1; the page loads nothing else (a
request for another host is refused and fails the test). ``MQTTJS_BUNDLE=/path/to/mqtt.min.js`` uses a bundle
fetched beforehand instead (a machine without the npm registry). The page comes from a loopback origin on purpose:
Chromium refuses WebSockets to 127.0.0.1 from about:blank or a routed page (ERR_BLOCKED_BY_LOCAL_NETWORK_ACCESS_CHECKS).

The page's clients connect to ``ws://HOST:PORT/mqtt`` (subprotocol ``mqtt``) of the normal client listener, as
MQTT 3.1.1 (protocolVersion 4) and 5.0, publish and subscribe; the tests assert on what the page received:
wildcards and QoS 1, retained messages, the way to and from native clients (user properties are fields), the
last will, and the entitlement's refusals as SUBACK and PUBACK reason codes.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import jwt
import pytest

from migratory.client import ClientMessage, MigratoryClient
from migratory.message import MessageType
from migratory.protocol import Status
from tests.conftest import ServerProcess
from tests.test_browser import ARGS, CHROMIUM  # the suite's Chromium and its flags

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page, Route

NPM = shutil.which("npm")
MQTTJS = "mqtt@5"
SUPPORT_JS = Path(__file__).resolve().parent / "mqtt_browser_support.js"
BUNDLE_ENV = "MQTTJS_BUNDLE"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/deps.sh installs it)"),
    pytest.mark.skipif(
        NPM is None and not os.environ.get(BUNDLE_ENV),
        reason=f"npm is not installed: MQTT.js ({MQTTJS}) is fetched with `npm pack` (or set {BUNDLE_ENV})",
    ),
]


WAIT_MS = 5000
"""The bound of every wait on the page (a CONNACK, a SUBACK, a PUBACK, a message)."""

VERSIONS = [pytest.param(4, id="mqtt311"), pytest.param(5, id="mqtt5")]

T = TypeVar("T")


# --- MQTT.js and the page ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mqttjs_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MQTT.js's browser bundle: ``npm pack mqtt@5`` once per session, ``package/dist/mqtt.min.js`` taken out."""
    given = os.environ.get(BUNDLE_ENV)
    if given:
        return Path(given)
    assert NPM is not None
    folder = tmp_path_factory.mktemp("mqttjs")
    packed = subprocess.run(
        [NPM, "pack", MQTTJS, "--json", "--pack-destination", str(folder)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if packed.returncode != 0:
        pytest.fail(f"`npm pack {MQTTJS}` failed (is the npm registry reachable?): {packed.stderr[-2000:]}")
    info = json.loads(packed.stdout)[0]
    with tarfile.open(folder / info["filename"]) as tarball:
        member = tarball.extractfile("package/dist/mqtt.min.js")
        assert member is not None, f"{info['filename']} has no dist/mqtt.min.js"
        bundle = folder / f"mqtt-{info['version']}.min.js"
        bundle.write_bytes(member.read())
    return bundle


@pytest.fixture(scope="module")
def page_origin(mqttjs_bundle: Path) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 for the test page, MQTT.js's bundle and the page's helpers."""
    files = {
        "/mqtt.min.js": mqttjs_bundle.read_bytes(),
        "/support.js": SUPPORT_JS.read_bytes(),
        "/": b'<!doctype html><meta charset="utf-8"><title>MQTT.js</title>'
        b'<script src="/mqtt.min.js"></script><script src="/support.js"></script>',
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            kind = "text/html" if self.path == "/" else "text/javascript"
            self.send_response(200)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    app = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=app.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{app.server_address[1]}/"
    app.shutdown()
    app.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    """A browser context whose pages reach 127.0.0.1 only: any other request is refused, and fails the test."""
    refused: list[str] = []

    def guard(route: Route) -> None:
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    ctx = browser.new_context()
    ctx.route("**/*", guard)
    yield ctx
    ctx.close()
    assert not refused, f"the page asked for something outside 127.0.0.1: {refused}"


class MqttPage:
    """One page with MQTT.js loaded; its clients are named, ``T`` in the page (mqtt_browser_support.js)."""

    def __init__(self, context: BrowserContext, origin: str, server: ServerProcess) -> None:
        self.page: Page = context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.goto(origin)
        self.page.wait_for_function("typeof mqtt === 'object' && typeof T === 'object'", timeout=WAIT_MS)
        self.url = f"ws://{server.host}:{server.port}/mqtt"

    def call(self, method: str, *args: Any) -> dict[str, Any]:
        result = self.page.evaluate(f"(args) => T.{method}(...args)", [*args, WAIT_MS])
        assert isinstance(result, dict)
        if "timeout" in result:
            raise AssertionError(f"{result['timeout']}; the events of {args[0]}: {self.events(args[0])}")
        return result

    def connect(self, name: str, version: int, **options: Any) -> dict[str, Any]:
        options = {"protocolVersion": version, "clientId": f"{name}-{version}", **options}
        connack = self.call("connect", name, self.url, options)
        assert connack.get("error") is None and connack["code"] == 0, connack
        return connack

    def subscribe(self, name: str, filters: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return self.call("subscribe", name, filters)

    def publish(self, name: str, topic: str, payload: str, **options: Any) -> dict[str, Any]:
        return self.call("publish", name, topic, payload, options)

    def end(self, name: str) -> None:
        self.call("end", name)

    def wait_messages(self, name: str, count: int) -> list[dict[str, Any]]:
        """The first ``count`` messages of client ``name``, once it has that many (within WAIT_MS)."""
        self._wait("([n, k]) => T.inbox[n].length >= k", name, count, f"{count} message(s)")
        return self.messages(name)[:count]

    def messages(self, name: str) -> list[dict[str, Any]]:
        inbox = self.page.evaluate("(n) => T.inbox[n]", name)
        assert isinstance(inbox, list)
        return inbox

    def events(self, name: str) -> list[str]:
        events = self.page.evaluate("(n) => T.events[n]", name)
        assert isinstance(events, list)
        return events

    def wait_event(self, name: str, event: str) -> list[str]:
        self._wait("([n, e]) => T.events[n].includes(e)", name, event, f"the event {event!r}")
        return self.events(name)

    def _wait(self, predicate: str, name: str, arg: Any, what: str) -> None:
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_function(predicate, arg=[name, arg], timeout=WAIT_MS)
        except PlaywrightTimeout:
            raise AssertionError(
                f"{name} did not get {what} within {WAIT_MS} ms; "
                f"it received {self.messages(name)}, its events: {self.events(name)}"
            ) from None


@pytest.fixture
def open_page(context: BrowserContext, page_origin: str) -> Iterator[Callable[[ServerProcess], MqttPage]]:
    pages: list[MqttPage] = []

    def factory(server: ServerProcess) -> MqttPage:
        pages.append(MqttPage(context, page_origin, server))
        return pages[-1]

    yield factory
    errors = [error for page in pages for error in page.errors]
    assert not errors, f"uncaught errors on the page: {errors}"


# --- the native client, on an event loop of its own ---------------------------------------------------------------


class Native:
    """A native :class:`MigratoryClient` on an event loop in a thread (Playwright's sync API holds this one's)."""

    def __init__(self, url: str, token: str = "") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make() -> MigratoryClient:
            client = MigratoryClient([url], token=token, reconnect=False, request_timeout=WAIT_MS / 1000)
            await client.connect()
            return client

        self.client = self.run(make())

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(2 * WAIT_MS / 1000)

    def subscribe(self, *subjects: str) -> dict[str, Status]:
        return self.run(self.client.subscribe(subjects))

    def publish(self, subject: str, content: str, **options: Any) -> Status:
        return self.run(self.client.publish(subject, content, **options))

    def next_message(self) -> ClientMessage:
        return self.run(self.client.next_message(WAIT_MS / 1000))

    def close(self) -> None:
        try:
            self.run(self.client.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()


@pytest.fixture
def native() -> Iterator[Callable[..., Native]]:
    started: list[Native] = []

    def factory(server: ServerProcess, token: str = "") -> Native:
        started.append(Native(server.ws_url, token))
        return started[-1]

    yield factory
    for client in started:
        client.close()


# --- the tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_wildcard_qos1_and_a_retained_message(
    version: int, server_factory: Callable[..., ServerProcess], open_page: Callable[[ServerProcess], MqttPage]
) -> None:
    server = server_factory({})
    first = open_page(server)
    first.connect("a", version)
    suback = first.subscribe("a", {"t/+/x": {"qos": 1}})
    assert suback["error"] is None and suback["codes"] == [1], suback
    puback = first.publish("a", "t/a/x", "one", qos=1)
    assert puback["error"] is None, puback
    (message,) = first.wait_messages("a", 1)
    assert message["topic"] == "t/a/x" and message["payload"] == "one", message
    assert message["qos"] == 1 and message["retain"] is False, message

    puback = first.publish("a", "t/r/x", "kept", qos=1, retain=True)
    assert puback["error"] is None, puback
    live = first.wait_messages("a", 2)[1]
    # a message forwarded to an established subscription has RETAIN 0 (3.1.1 [MQTT-3.3.1-9]; 5.0 without RAP)
    assert live["topic"] == "t/r/x" and live["payload"] == "kept" and live["retain"] is False, live

    second = open_page(server)
    second.connect("b", version)
    suback = second.subscribe("b", {"t/+/x": {"qos": 1}})
    assert suback["error"] is None and suback["codes"] == [1], suback
    first.publish("a", "t/end/x", "sentinel", qos=1)  # not retained: after whatever the subscription brought
    received = second.wait_messages("b", 2)
    assert received[-1]["topic"] == "t/end/x" and received[-1]["retain"] is False, received
    # the retained message, and only it: t/a/x was published without RETAIN, so nothing of it is kept
    # (3.1.1 [MQTT-3.3.1-12], 5.0 section 3.3.1.3)
    (retained,) = received[:-1]
    assert retained["topic"] == "t/r/x" and retained["payload"] == "kept", retained
    assert retained["retain"] is True and retained["qos"] == 1, retained


@pytest.mark.parametrize("version", VERSIONS)
def test_native_and_mqttjs_clients_reach_each_other(
    version: int,
    server_factory: Callable[..., ServerProcess],
    open_page: Callable[[ServerProcess], MqttPage],
    native: Callable[..., Native],
) -> None:
    server = server_factory({})
    page = open_page(server)
    page.connect("js", version)
    suback = page.subscribe("js", {"x/from-native": {"qos": 1}})
    assert suback["error"] is None and suback["codes"] == [1], suback

    python = native(server)
    # native -> MQTT.js: a guaranteed publication comes at QoS 1, its fields as user properties (5.0)
    status = python.publish("/x/from-native", "hello", fields={"k": "v", "price": "1.5"}, guaranteed=True)
    assert status is Status.OK
    (message,) = page.wait_messages("js", 1)
    assert message["topic"] == "x/from-native" and message["payload"] == "hello", message
    assert message["qos"] == 1 and message["retain"] is False, message
    assert message["userProperties"] == ({"k": "v", "price": "1.5"} if version == 5 else None), message

    # MQTT.js -> native: the payload is the content, user properties (5.0) are the message's fields
    assert python.subscribe("/x/from-js") == {"/x/from-js": Status.OK}
    options: dict[str, Any] = {"qos": 1}
    if version == 5:
        options["properties"] = {"userProperties": {"color": "blue", "n": "1"}}
    puback = page.publish("js", "x/from-js", "hi from the browser", **options)
    assert puback["error"] is None, puback
    got = python.next_message()
    assert got.subject == "/x/from-js" and got.content == b"hi from the browser", got
    assert got.type is MessageType.UPDATE, got
    assert dict(got.fields) == ({"color": "blue", "n": "1"} if version == 5 else {}), got


@pytest.mark.parametrize("version", VERSIONS)
def test_the_last_will_when_the_page_goes_away(
    version: int, server_factory: Callable[..., ServerProcess], open_page: Callable[[ServerProcess], MqttPage]
) -> None:
    server = server_factory({})
    watcher = open_page(server)
    watcher.connect("watcher", version)
    suback = watcher.subscribe("watcher", {"w/status": {"qos": 1}})
    assert suback["error"] is None and suback["codes"] == [1], suback

    # a client that ends cleanly (DISCONNECT, reason 0) leaves no will
    polite = open_page(server)
    polite.connect("polite", version, will={"topic": "w/status", "payload": "polite is gone", "qos": 1})
    polite.end("polite")

    # a page that just goes away: the connection ends without DISCONNECT, the server publishes the will
    will: dict[str, Any] = {"topic": "w/status", "payload": "abrupt is gone", "qos": 1, "retain": False}
    if version == 5:
        will["properties"] = {"userProperties": {"why": "page closed"}}
    abrupt = open_page(server)
    abrupt.connect("abrupt", version, will=will)
    abrupt.page.close()

    (message,) = watcher.wait_messages("watcher", 1)  # the polite client's will would have come first
    assert message["topic"] == "w/status" and message["payload"] == "abrupt is gone", message
    assert message["qos"] == 1 and message["retain"] is False, message
    if version == 5:
        assert message["userProperties"] == {"why": "page closed"}, message


SECRET = "mqtt-browser-test-secret-0123456789abcdef"


@pytest.mark.parametrize("version", VERSIONS)
def test_entitlement_refusals_are_reason_codes(
    version: int, server_factory: Callable[..., ServerProcess], open_page: Callable[[ServerProcess], MqttPage]
) -> None:
    server = server_factory({"Entitlement": "JWT", "EntitlementJwtSecret": SECRET})
    limited = jwt.encode({"permissions": {"sub": ["/ok/**"], "pub": ["/ok/**"]}}, SECRET, "HS256")
    everything = jwt.encode({"permissions": {"sub": ["/ok/**", "/no/**"], "pub": []}}, SECRET, "HS256")
    refused = 0x87 if version == 5 else 0x80  # 5.0: Not authorized; 3.1.1: Failure

    page = open_page(server)
    page.connect("admin", version, username="admin", password=everything)
    suback = page.subscribe("admin", {"ok/a": {"qos": 1}, "no/a": {"qos": 1}})
    assert suback["error"] is None and suback["codes"] == [1, 1], suback

    page.connect("user", version, username="user", password=limited)
    # one SUBSCRIBE, two filters: the allowed one granted, the other refused, each with its own code in order
    suback = page.subscribe("user", {"ok/b": {"qos": 1}, "no/b": {"qos": 1}})
    assert suback["codes"] == [1, refused], suback
    # MQTT.js reports a code >= 0x80 as a subscribe error, with the code's name
    assert suback["error"] is not None, suback
    assert suback["error"]["message"] == f"Subscribe error: {'Not authorized' if version == 5 else 'Unspecified error'}"
    suback = page.subscribe("user", {"no/+": {"qos": 0}})
    assert suback["codes"] == [refused], suback

    if version == 5:
        puback = page.publish("user", "no/a", "forbidden", qos=1)
        assert puback["error"] is not None and puback["error"]["code"] == 0x87, puback
        assert "Not authorized" in puback["error"]["message"], puback
        assert page.publish("user", "ok/a", "allowed", qos=1)["error"] is None
    else:
        # 3.1.1 has no negative PUBACK: the server closes the connection ([MQTT-3.3.5-2])
        assert page.publish("user", "no/a", "forbidden", qos=1).get("closed") is True
        page.wait_event("user", "close")
        page.connect("user2", version, username="user", password=limited)
        assert page.publish("user2", "ok/a", "allowed", qos=1)["error"] is None

    # the refused publication reached nobody: the allowed one, published after it, is the first that came
    (message,) = page.wait_messages("admin", 1)
    assert message["topic"] == "ok/a" and message["payload"] == "allowed", message

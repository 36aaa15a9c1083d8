// The JavaScript client of the MigratoryData-class server: browsers and Node, no dependencies.
//
// It speaks the native protocol, version 3 (docs/protocol.md), with the same API and the
// same behaviour as the Python client (migratory/client.py): a list of servers with weights,
// a member picked at random by weight, reconnection to another member with exponential
// backoff and jitter, resubscription with the position (epoch, seq) of the last message
// of each subject so that a cluster resends what was missed (RECOVERED) or resynchronises
// (NOTIFY_DATA_RESYNC and the snapshot), no duplicate and no out-of-order message for the
// application, publish ids that make retries idempotent, and status events named as in
// the product's API. Where WebSocket does not get through (a proxy that strips Upgrade),
// it falls back to HTTP streaming on the same port (docs/protocol.md, "HTTP streaming").
//
//   import { MigratoryClient } from "/migratory.js";
//   const client = new MigratoryClient(["ws://127.0.0.1:8800"], {
//     onMessage: (m) => console.log(m.type, m.subject, m.text, m.fields),
//     onStatus: (e) => console.log(e.kind, e.detail || e.subject),
//   });
//   await client.connect();
//   await client.subscribe(["/Stocks/NYSE/IBM"]);
//   await client.publish("/Stocks/NYSE/IBM", "193", { fields: { volume: "6.62M" } });

export const PROTOCOL_VERSION = 3;
export const DEFAULT_WEIGHT = 100;

export const Status = Object.freeze({
  OK: 0,
  DENIED: 1,
  FAILED: 2,
  NO_SUBSCRIBER: 3,
  INVALID_SUBJECT: 4,
  TOO_LARGE: 5,
  LIMIT_EXCEEDED: 6,
  REVOKED: 7,
  NOT_CONNECTED: 8,
  PROTOCOL_ERROR: 9,
});
const STATUS_NAMES = Object.fromEntries(Object.entries(Status).map(([k, v]) => [v, k]));
export function statusName(code) {
  return STATUS_NAMES[code] ?? `STATUS_${code}`;
}

export const MessageType = Object.freeze({ SNAPSHOT: "SNAPSHOT", UPDATE: "UPDATE", RECOVERED: "RECOVERED" });

export const EventKind = Object.freeze({
  NOTIFY_SERVER_UP: "NOTIFY_SERVER_UP",
  NOTIFY_SERVER_DOWN: "NOTIFY_SERVER_DOWN",
  NOTIFY_DATA_SYNC: "NOTIFY_DATA_SYNC",
  NOTIFY_DATA_RESYNC: "NOTIFY_DATA_RESYNC",
  SUBSCRIBE_ALLOW: "SUBSCRIBE_ALLOW",
  SUBSCRIBE_DENY: "SUBSCRIBE_DENY",
  PUBLISH_OK: "PUBLISH_OK",
  PUBLISH_NO_SUBSCRIBER: "PUBLISH_NO_SUBSCRIBER",
  PUBLISH_DENIED: "PUBLISH_DENIED",
  PUBLISH_FAILED: "PUBLISH_FAILED",
  ERROR: "ERROR",
});

const Op = Object.freeze({
  CONNECT: 0x01,
  SUBSCRIBE: 0x02,
  UNSUBSCRIBE: 0x03,
  PUBLISH: 0x04,
  CONNECTED: 0x81,
  SUBSCRIBE_STATUS: 0x82,
  MESSAGE: 0x83,
  PUBLISH_STATUS: 0x84,
  NOTIFY: 0x85,
  ERROR: 0x8f,
});

// --- the codec (pure functions; exported for tests) -----------------------------------------

const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true });

export class DecodeError extends Error {}

function pushVarint(out, value) {
  if (!Number.isSafeInteger(value) || value < 0) throw new RangeError(`varint out of range: ${value}`);
  while (value >= 0x80) {
    out.push((value % 0x80) | 0x80);
    value = Math.floor(value / 0x80);
  }
  out.push(value);
}

function pushBytes(out, bytes) {
  for (let i = 0; i < bytes.length; i++) out.push(bytes[i]);
}

function pushString(out, text) {
  const bytes = encoder.encode(text);
  pushVarint(out, bytes.length);
  pushBytes(out, bytes);
}

function pushFields(out, fields) {
  const entries = Object.entries(fields ?? {});
  pushVarint(out, entries.length);
  for (const [name, value] of entries) {
    pushString(out, name);
    pushString(out, String(value));
  }
}

function toBytes(content) {
  if (content instanceof Uint8Array) return content;
  if (content instanceof ArrayBuffer) return new Uint8Array(content);
  return encoder.encode(String(content));
}

export function encodeConnect(token = "", version = PROTOCOL_VERSION) {
  const out = [Op.CONNECT];
  pushVarint(out, version);
  pushString(out, token);
  return Uint8Array.from(out);
}

export function encodeSubscribe(subjects, conflationMs = 0, positions = null) {
  const out = [Op.SUBSCRIBE, positions ? 0x01 : 0x00];
  pushVarint(out, conflationMs);
  pushVarint(out, subjects.length);
  subjects.forEach((subject, i) => {
    pushString(out, subject);
    if (positions) {
      pushVarint(out, positions[i][0]);
      pushVarint(out, positions[i][1]);
    }
  });
  return Uint8Array.from(out);
}

export function encodeUnsubscribe(subjects) {
  const out = [Op.UNSUBSCRIBE];
  pushVarint(out, subjects.length);
  for (const subject of subjects) pushString(out, subject);
  return Uint8Array.from(out);
}

export function encodePublish(subject, content, { fields = {}, closure = "", retained = true, guaranteed = false, publishId = "" } = {}) {
  const flags = (retained ? 0x01 : 0) | (guaranteed ? 0x02 : 0) | (publishId ? 0x04 : 0);
  const head = [Op.PUBLISH, flags];
  pushString(head, closure);
  if (publishId) pushString(head, publishId);
  pushString(head, subject);
  pushFields(head, fields);
  const body = toBytes(content);
  const frame = new Uint8Array(head.length + body.length);
  frame.set(head, 0);
  frame.set(body, head.length);
  return frame;
}

class Reader {
  constructor(data) {
    this.data = data;
    this.pos = 1;
  }
  byte(what) {
    if (this.pos >= this.data.length) throw new DecodeError(`truncated message: missing ${what}`);
    return this.data[this.pos++];
  }
  varint(what) {
    let result = 0;
    let scale = 1;
    for (;;) {
      const b = this.byte(what);
      result += (b & 0x7f) * scale;
      if (b < 0x80) return result;
      scale *= 0x80;
      if (scale > 2 ** 63) throw new DecodeError(`${what}: varint longer than 64 bits`);
    }
  }
  string(what) {
    const length = this.varint(what);
    const end = this.pos + length;
    if (end > this.data.length) throw new DecodeError(`truncated message: ${what} claims ${length} bytes`);
    const raw = this.data.subarray(this.pos, end);
    this.pos = end;
    try {
      return decoder.decode(raw);
    } catch {
      throw new DecodeError(`${what} is not valid UTF-8`);
    }
  }
  fields() {
    const count = this.varint("field count");
    const out = {};
    for (let i = 0; i < count; i++) {
      const name = this.string("field name");
      out[name] = this.string("field value");
    }
    return out;
  }
  rest() {
    const out = this.data.subarray(this.pos);
    this.pos = this.data.length;
    return out;
  }
  end() {
    if (this.pos !== this.data.length) throw new DecodeError(`${this.data.length - this.pos} unexpected trailing bytes`);
  }
}

export function decodeServer(data) {
  if (!(data instanceof Uint8Array)) data = new Uint8Array(data);
  if (!data.length) throw new DecodeError("empty message");
  const r = new Reader(data);
  switch (data[0]) {
    case Op.MESSAGE: {
      const flags = r.byte("flags");
      const subject = r.string("subject");
      const fields = r.fields();
      const seq = r.varint("seq");
      const epoch = r.varint("epoch");
      return {
        op: "MESSAGE",
        subject,
        fields,
        seq,
        epoch,
        content: r.rest(),
        snapshot: Boolean(flags & 0x01),
        retained: Boolean(flags & 0x02),
        guaranteed: Boolean(flags & 0x04),
        recovered: Boolean(flags & 0x08),
      };
    }
    case Op.CONNECTED: {
      const version = r.varint("version");
      const session = r.string("session");
      const epoch = r.varint("epoch");
      const maxMessageSize = version >= 2 ? r.varint("message size limit") : 0;
      const keepaliveMs = version >= 3 ? r.varint("keep-alive") : 0;
      r.end();
      return { op: "CONNECTED", version, session, epoch, maxMessageSize, keepaliveMs };
    }
    case Op.SUBSCRIBE_STATUS: {
      const status = r.byte("status");
      const subject = r.string("subject");
      const reason = r.string("reason");
      r.end();
      return { op: "SUBSCRIBE_STATUS", status, subject, reason };
    }
    case Op.PUBLISH_STATUS: {
      const status = r.byte("status");
      const closure = r.string("closure");
      const reason = r.string("reason");
      r.end();
      return { op: "PUBLISH_STATUS", status, closure, reason };
    }
    case Op.NOTIFY: {
      const code = r.byte("code");
      const subject = r.string("subject");
      r.end();
      if (code !== 1 && code !== 2 && code !== 3) throw new DecodeError(`unknown notify code ${code}`);
      return { op: "NOTIFY", code: ["", "DATA_SYNC", "DATA_RESYNC", "KEEPALIVE"][code], subject };
    }
    case Op.ERROR: {
      const status = r.varint("status");
      const reason = r.string("reason");
      r.end();
      return { op: "ERROR", status, reason };
    }
    default:
      throw new DecodeError(`unknown opcode 0x${data[0].toString(16)}`);
  }
}

// --- server lists ----------------------------------------------------------------------------

export function parseServers(servers) {
  const out = [];
  for (const item of servers) {
    let url;
    let weight = DEFAULT_WEIGHT;
    if (Array.isArray(item)) {
      [url, weight] = item;
    } else {
      const text = String(item).trim();
      const space = text.indexOf(" ");
      if (space > 0 && !text.startsWith("ws://") && !text.startsWith("wss://")) {
        weight = Number(text.slice(0, space));
        url = text.slice(space + 1).trim();
        if (!Number.isFinite(weight)) throw new TypeError(`expected 'WEIGHT URL' or 'URL', got ${JSON.stringify(item)}`);
      } else {
        url = text;
      }
    }
    if (!/^wss?:\/\//.test(url)) throw new TypeError(`server URL must start with ws:// or wss://: ${JSON.stringify(url)}`);
    if (!(weight > 0)) throw new TypeError(`server weight must be positive: ${url} has ${weight}`);
    out.push({ url, weight: Number(weight) });
  }
  if (!out.length) throw new TypeError("at least one server is required");
  return out;
}

function pickServer(servers, exclude) {
  const candidates = servers.filter((s) => s !== exclude);
  const pool = candidates.length ? candidates : servers;
  const total = pool.reduce((sum, s) => sum + s.weight, 0);
  let point = Math.random() * total;
  for (const server of pool) {
    point -= server.weight;
    if (point <= 0) return server;
  }
  return pool[pool.length - 1];
}

function randomId() {
  const bytes = new Uint8Array(8);
  (globalThis.crypto ?? { getRandomValues: (b) => b.map(() => Math.floor(Math.random() * 256)) }).getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// --- transports -------------------------------------------------------------------------------

// A transport carries whole native messages both ways: send(bytes), close(), and the
// callbacks onopen(), onmessage(bytes), onclose(reason).

class WebSocketTransport {
  constructor(url, WebSocketImpl) {
    this.name = "websocket";
    const ws = new WebSocketImpl(url, ["migratory.v1"]);
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    this.opened = false;
    ws.onopen = () => {
      this.opened = true;
      this.onopen?.();
    };
    ws.onmessage = (event) => {
      if (typeof event.data === "string") {
        this.onclose?.("the server sent a text message");
        ws.close();
        return;
      }
      this.onmessage?.(new Uint8Array(event.data));
    };
    ws.onclose = (event) => this.onclose?.(`closed: ${event.code} ${event.reason ?? ""}`.trim(), this.opened);
    ws.onerror = () => {};
  }
  send(bytes) {
    this.ws.send(bytes);
  }
  close() {
    try {
      this.ws.close();
    } catch {
      // already closed
    }
  }
}

// HTTP streaming (docs/protocol.md): one long GET carries the server's messages as
// length-prefixed frames; each of ours is a POST. Used when WebSocket does not get through.
class HttpStreamTransport {
  constructor(url, fetchImpl) {
    this.name = "http-stream";
    this.base = url.replace(/^ws/, "http").replace(/\/$/, "");
    this.fetch = fetchImpl;
    this.abort = new AbortController();
    this.session = "";
    this.queue = Promise.resolve();
    this.closed = false;
    this.start();
  }
  async start() {
    let answer;
    try {
      answer = await this.fetch(`${this.base}/stream`, { method: "GET", signal: this.abort.signal, cache: "no-store" });
    } catch (error) {
      this.finish(`http stream: ${error?.message ?? error}`, false);
      return;
    }
    if (!answer.ok || !answer.body) {
      this.finish(`http stream: HTTP ${answer.status}`, false);
      return;
    }
    this.session = answer.headers.get("x-migratory-stream") ?? "";
    this.onopen?.();
    const reader = answer.body.getReader();
    let buffer = new Uint8Array(0);
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const joined = new Uint8Array(buffer.length + value.length);
        joined.set(buffer);
        joined.set(value, buffer.length);
        buffer = joined;
        while (buffer.length >= 4) {
          const length = new DataView(buffer.buffer, buffer.byteOffset, 4).getUint32(0);
          if (buffer.length < 4 + length) break;
          const frame = buffer.slice(4, 4 + length);
          buffer = buffer.subarray(4 + length);
          if (length) this.onmessage?.(frame); // a zero-length frame keeps proxies from idling us out
        }
      }
      this.finish("http stream ended", true);
    } catch (error) {
      this.finish(`http stream: ${error?.message ?? error}`, true);
    }
  }
  finish(reason, opened) {
    if (this.closed) return;
    this.closed = true;
    this.onclose?.(reason, opened);
  }
  send(bytes) {
    // one POST per message, in order
    this.queue = this.queue.then(async () => {
      if (this.closed) return;
      try {
        const answer = await this.fetch(`${this.base}/stream/${encodeURIComponent(this.session)}`, {
          method: "POST",
          body: bytes,
          headers: { "Content-Type": "application/octet-stream" },
        });
        if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
        await answer.arrayBuffer();
      } catch (error) {
        this.close();
        this.finish(`http post: ${error?.message ?? error}`, true);
      }
    });
  }
  close() {
    this.abort.abort();
  }
}

// --- the client ---------------------------------------------------------------------------------

export class MigratoryClient {
  constructor(servers, options = {}) {
    this.servers = parseServers(servers);
    this.token = options.token ?? "";
    this.onMessage = options.onMessage ?? null;
    this.onStatus = options.onStatus ?? null;
    this.reconnect = options.reconnect ?? true;
    this.backoffInitial = options.backoffInitial ?? 100;
    this.backoffMax = options.backoffMax ?? 10000;
    this.requestTimeout = options.requestTimeout ?? 10000;
    this.transportChoice = options.transport ?? "auto"; // "auto", "websocket" or "http-stream"
    this.WebSocket = options.WebSocket ?? globalThis.WebSocket;
    this.fetch = options.fetch ?? globalThis.fetch?.bind(globalThis);
    this.subscriptions = new Map(); // subject -> conflation ms
    this.positions = new Map(); // subject -> [epoch, seq]
    this.pendingPublishes = new Map(); // closure -> resolve
    this.pendingSubscribes = new Map(); // subject -> [resolve]
    this.queue = [];
    this.waiters = [];
    this.transport = null;
    this.connected = false;
    this.closing = false;
    this.session = "";
    this.server = "";
    this.transportName = "";
    this.maxMessageSize = 0;
    this.duplicatesDropped = 0;
    this.counter = 0;
    this.idPrefix = randomId();
    this.connectedWaiters = [];
    this.websocketFailed = new Set();
    this.loop = null;
  }

  // --- lifecycle ---

  connect(timeout = this.requestTimeout) {
    if (!this.loop) this.loop = this.run();
    return this.waitConnected(timeout);
  }

  waitConnected(timeout = this.requestTimeout) {
    if (this.connected) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const entry = { resolve, timer: null };
      entry.timer = setTimeout(() => {
        this.connectedWaiters = this.connectedWaiters.filter((e) => e !== entry);
        reject(new Error(`not connected within ${timeout} ms`));
      }, timeout);
      this.connectedWaiters.push(entry);
    });
  }

  close() {
    this.closing = true;
    this.transport?.close();
    this.failPending("closed");
  }

  position(subject) {
    return this.positions.get(subject) ?? null;
  }

  // --- requests ---

  async subscribe(subjects, { conflationMs = 0 } = {}) {
    if (conflationMs < 0) throw new RangeError(`conflationMs must be 0 or more, got ${conflationMs}`);
    const waits = subjects.map((subject) => {
      this.subscriptions.set(subject, conflationMs);
      return this.waitFor(this.pendingSubscribes, subject);
    });
    if (this.connected) this.send(this.subscribeFrame(subjects, conflationMs));
    const statuses = await Promise.all(waits);
    return Object.fromEntries(subjects.map((s, i) => [s, statuses[i].status]));
  }

  waitFor(map, key) {
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        const list = map.get(key) ?? [];
        map.set(key, list.filter((r) => r !== done));
        resolve({ status: Status.FAILED, reason: "no answer in time" });
      }, this.requestTimeout);
      const done = (answer) => {
        clearTimeout(timer);
        resolve(answer);
      };
      map.set(key, [...(map.get(key) ?? []), done]);
    });
  }

  subscribeFrame(subjects, conflationMs) {
    const positions = subjects.map((s) => this.positions.get(s) ?? [0, 0]);
    return encodeSubscribe(subjects, conflationMs, positions.some(([e, q]) => e || q) ? positions : null);
  }

  unsubscribe(subjects) {
    const known = subjects.filter((s) => this.subscriptions.delete(s));
    for (const subject of known) this.positions.delete(subject);
    if (known.length && this.connected) this.send(encodeUnsubscribe(known));
  }

  newPublishId() {
    this.counter += 1;
    return `${this.idPrefix}-${this.counter}`;
  }

  async publish(subject, content, options = {}) {
    return (await this.publishRetrying(subject, content, options)).status;
  }

  // {status, reason, attempts, publishId}: publishOnce, sent again (same publish id) while FAILED and retries remain.
  async publishRetrying(subject, content, options = {}) {
    const publishId = options.publishId ?? this.newPublishId();
    const closure = options.closure ?? publishId;
    const retries = options.retries ?? 0;
    let answer;
    let attempts = 0;
    for (let attempt = 0; attempt <= retries; attempt++) {
      attempts += 1;
      answer = await this.publishOnce(subject, content, { ...options, publishId, closure });
      if (answer.status !== Status.FAILED || attempt === retries || this.closing) break;
      await sleep(Math.min(1000, 50 * 2 ** attempt) * (0.5 + Math.random() / 2));
      await this.waitConnected().catch(() => {});
    }
    return { ...answer, attempts, publishId };
  }

  // Pipelined publishing: up to `window` publications awaiting their status at once, `rate` a second at most (0: no
  // limit). Yields one result per publication, {index, publication, publishId, status, reason, attempts, ok}, in
  // the order the server answers; publications of a subject are sent in input order. `publications` is any
  // iterable or async iterable of {subject, content, fields?, retained?, guaranteed?, publishId?}.
  async *publishAll(publications, { window = 64, rate = 0, retries = 0 } = {}) {
    if (!(window >= 1)) throw new RangeError(`window must be 1 or more, got ${window}`);
    if (!(rate >= 0)) throw new RangeError(`rate must be 0 or more, got ${rate}`);
    const finished = [];
    let wake = null;
    let inflight = 0;
    let index = 0;
    const start = Date.now();
    const settled = () => new Promise((resolve) => { wake = resolve; });
    const send = (publication, at) => {
      inflight += 1;
      const { subject, content, ...options } = publication;
      this.publishRetrying(subject, content, { ...options, retries }).then((answer) => {
        inflight -= 1;
        const ok = answer.status === Status.OK || answer.status === Status.NO_SUBSCRIBER;
        finished.push({ index: at, publication, publishId: answer.publishId, status: answer.status,
          reason: answer.reason ?? "", attempts: answer.attempts, ok });
        if (wake) wake();
      });
    };
    for await (const publication of publications) {
      while (finished.length) yield finished.shift();
      while (inflight >= window) {
        await settled();
        while (finished.length) yield finished.shift();
      }
      const due = rate ? start + (index * 1000) / rate - Date.now() : 0;
      if (due > 0) {
        await Promise.race([sleep(due), settled()]);
        while (finished.length) yield finished.shift();
        const left = start + (index * 1000) / rate - Date.now();
        if (left > 0) await sleep(left);
      }
      send(publication, index);
      index += 1;
    }
    while (inflight || finished.length) {
      if (!finished.length) await settled();
      while (finished.length) yield finished.shift();
    }
  }

  async publishOnce(subject, content, options) {
    const bytes = toBytes(content);
    if (this.maxMessageSize && bytes.length > this.maxMessageSize) {
      const reason = `content of ${bytes.length} bytes exceeds the server's MessageSizeLimit (${this.maxMessageSize})`;
      this.emit({ kind: EventKind.PUBLISH_FAILED, detail: reason, subject, closure: options.closure, status: Status.TOO_LARGE });
      return { status: Status.TOO_LARGE, reason };
    }
    if (!this.connected) {
      this.emit({ kind: EventKind.PUBLISH_FAILED, detail: "not connected", subject, closure: options.closure, status: Status.FAILED });
      return { status: Status.FAILED, reason: "not connected" };
    }
    const wait = this.waitFor(this.pendingPublishes, options.closure);
    this.send(encodePublish(subject, bytes, options));
    return wait;
  }

  nextMessage(timeout = this.requestTimeout) {
    if (this.queue.length) return Promise.resolve(this.queue.shift());
    return new Promise((resolve, reject) => {
      const entry = { resolve, timer: null };
      entry.timer = setTimeout(() => {
        this.waiters = this.waiters.filter((e) => e !== entry);
        reject(new Error(`no message within ${timeout} ms`));
      }, timeout);
      this.waiters.push(entry);
    });
  }

  // --- connection loop ---

  async run() {
    let delay = this.backoffInitial;
    let last = null;
    while (!this.closing) {
      const server = pickServer(this.servers, last);
      const kind = this.chooseTransport(server);
      const outcome = await this.session_(server, kind);
      const wasUp = outcome.up;
      this.connected = false;
      this.transport = null;
      this.failPending("connection lost");
      if (wasUp) delay = this.backoffInitial;
      if (this.closing) return;
      if (kind === "websocket" && !outcome.opened && this.transportChoice === "auto") {
        this.websocketFailed.add(server.url); // next time, try HTTP streaming there
      }
      this.emit({ kind: EventKind.NOTIFY_SERVER_DOWN, detail: `${server.url}: ${outcome.reason}` });
      if (!this.reconnect) return;
      last = server;
      await sleep(delay * (0.5 + Math.random() / 2)); // jitter: a crowd of clients does not return at once
      delay = Math.min(delay * 2, this.backoffMax);
    }
  }

  chooseTransport(server) {
    if (this.transportChoice !== "auto") return this.transportChoice;
    if (!this.WebSocket) return "http-stream";
    return this.websocketFailed.has(server.url) ? "http-stream" : "websocket";
  }

  session_(server, kind) {
    return new Promise((resolve) => {
      let up = false;
      let settled = false;
      const transport = kind === "websocket" ? new WebSocketTransport(server.url, this.WebSocket) : new HttpStreamTransport(server.url, this.fetch);
      this.transport = transport;
      const openTimer = setTimeout(() => {
        if (!up) {
          transport.close();
          finish("no answer to CONNECT in time", false);
        }
      }, this.requestTimeout);
      // protocol version 3: a server silent for longer than its keep-alive, plus half a second, is taken for hung
      // (a paused cluster member closes nothing): the transport is closed and another member is tried
      let keepalive = 0;
      let heard = Date.now();
      let watchdog = null;
      const finish = (reason, opened) => {
        if (settled) return;
        settled = true;
        clearTimeout(openTimer);
        if (watchdog) clearInterval(watchdog);
        resolve({ up, opened: opened || up, reason });
      };
      transport.onopen = () => transport.send(encodeConnect(this.token));
      transport.onclose = (reason, opened) => finish(reason, opened);
      transport.onmessage = (bytes) => {
        heard = Date.now();
        let frame;
        try {
          frame = decodeServer(bytes);
        } catch (error) {
          transport.close();
          finish(`undecodable message: ${error.message}`, true);
          return;
        }
        if (frame.op === "CONNECTED") {
          up = true;
          clearTimeout(openTimer);
          this.session = frame.session;
          this.server = server.url;
          this.transportName = transport.name;
          this.maxMessageSize = frame.maxMessageSize;
          keepalive = frame.keepaliveMs;
          if (keepalive) {
            watchdog = setInterval(() => {
              if (Date.now() - heard > keepalive + 500) {
                transport.close();
                finish(`no word from the server for ${((keepalive + 500) / 1000).toFixed(1)} s (its keep-alive)`, true);
              }
            }, 250);
          }
          this.resubscribe();
          this.connected = true;
          for (const entry of this.connectedWaiters.splice(0)) {
            clearTimeout(entry.timer);
            entry.resolve();
          }
          this.emit({ kind: EventKind.NOTIFY_SERVER_UP, detail: server.url });
          return;
        }
        this.handle(frame);
      };
    });
  }

  resubscribe() {
    const byPeriod = new Map();
    for (const [subject, period] of this.subscriptions) {
      byPeriod.set(period, [...(byPeriod.get(period) ?? []), subject]);
    }
    for (const [period, subjects] of byPeriod) this.transport.send(this.subscribeFrame(subjects, period));
  }

  send(bytes) {
    if (!this.transport) throw new Error("not connected");
    this.transport.send(bytes);
  }

  // --- incoming ---

  accept(frame) {
    if (frame.snapshot) {
      this.positions.set(frame.subject, [frame.epoch, frame.seq]);
      return true;
    }
    const last = this.positions.get(frame.subject);
    if (last && frame.seq <= last[1]) {
      this.duplicatesDropped += 1;
      return false;
    }
    this.positions.set(frame.subject, [frame.epoch, frame.seq]);
    return true;
  }

  handle(frame) {
    switch (frame.op) {
      case "MESSAGE": {
        if (!this.subscriptions.has(frame.subject) || !this.accept(frame)) return;
        const type = frame.snapshot ? MessageType.SNAPSHOT : frame.recovered ? MessageType.RECOVERED : MessageType.UPDATE;
        const content = frame.content;
        const message = {
          subject: frame.subject,
          content,
          get text() {
            return new TextDecoder().decode(content);
          },
          fields: frame.fields,
          type,
          seq: frame.seq,
          epoch: frame.epoch,
          retained: frame.retained,
        };
        if (this.onMessage) {
          try {
            this.onMessage(message);
          } catch (error) {
            console.error("migratory: message listener failed", error);
          }
        } else if (this.waiters.length) {
          const entry = this.waiters.shift();
          clearTimeout(entry.timer);
          entry.resolve(message);
        } else {
          this.queue.push(message);
        }
        return;
      }
      case "PUBLISH_STATUS": {
        const waiting = this.pendingPublishes.get(frame.closure);
        if (waiting?.length) {
          this.pendingPublishes.delete(frame.closure);
          waiting[0]({ status: frame.status, reason: frame.reason });
        }
        const kind =
          { [Status.OK]: EventKind.PUBLISH_OK, [Status.NO_SUBSCRIBER]: EventKind.PUBLISH_NO_SUBSCRIBER, [Status.DENIED]: EventKind.PUBLISH_DENIED }[
            frame.status
          ] ?? EventKind.PUBLISH_FAILED;
        this.emit({ kind, detail: frame.reason, closure: frame.closure, status: frame.status });
        return;
      }
      case "SUBSCRIBE_STATUS": {
        const waiting = this.pendingSubscribes.get(frame.subject);
        if (waiting?.length) {
          const resolve = waiting.shift();
          if (!waiting.length) this.pendingSubscribes.delete(frame.subject);
          resolve({ status: frame.status, reason: frame.reason });
        }
        if (frame.status === Status.OK) {
          this.emit({ kind: EventKind.SUBSCRIBE_ALLOW, subject: frame.subject, status: frame.status });
        } else {
          this.subscriptions.delete(frame.subject);
          this.positions.delete(frame.subject);
          this.emit({ kind: EventKind.SUBSCRIBE_DENY, detail: frame.reason, subject: frame.subject, status: frame.status });
        }
        return;
      }
      case "NOTIFY":
        if (frame.code === "KEEPALIVE") return;
        if (frame.code === "DATA_RESYNC") {
          this.positions.delete(frame.subject); // the snapshot that follows starts afresh
          this.emit({ kind: EventKind.NOTIFY_DATA_RESYNC, subject: frame.subject });
        } else {
          this.emit({ kind: EventKind.NOTIFY_DATA_SYNC, subject: frame.subject });
        }
        return;
      case "ERROR":
        if (frame.status === Status.TOO_LARGE) {
          const [closure, waiting] = this.pendingPublishes.entries().next().value ?? [];
          if (waiting) {
            this.pendingPublishes.delete(closure);
            waiting[0]({ status: Status.TOO_LARGE, reason: frame.reason });
          }
        }
        this.emit({ kind: EventKind.ERROR, detail: frame.reason, status: frame.status });
        return;
      default:
    }
  }

  failPending(reason) {
    for (const [closure, waiting] of this.pendingPublishes) {
      for (const resolve of waiting) resolve({ status: Status.FAILED, reason });
      this.pendingPublishes.delete(closure);
    }
  }

  emit(event) {
    if (!this.onStatus) return;
    try {
      this.onStatus({ detail: "", subject: "", closure: "", status: null, ...event });
    } catch (error) {
      console.error("migratory: status listener failed", error);
    }
  }
}

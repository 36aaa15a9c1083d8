// The codec and the client's bookkeeping, without a server (node --test).
import assert from "node:assert/strict";
import test from "node:test";

import {
  DecodeError,
  decodeServer,
  encodeConnect,
  encodePublish,
  encodeSubscribe,
  MigratoryClient,
  parseServers,
} from "../migratory.js";

test("CONNECT, SUBSCRIBE with positions and PUBLISH with a publish id are laid out as docs/protocol.md says", () => {
  assert.deepEqual([...encodeConnect("tok")], [0x01, 3, 3, 0x74, 0x6f, 0x6b]);
  assert.deepEqual([...encodeSubscribe(["/a/b"], 500)], [0x02, 0, 0xf4, 0x03, 1, 4, ...Buffer.from("/a/b")]);
  assert.deepEqual([...encodeSubscribe(["/a/b"], 0, [[7, 300]])], [0x02, 1, 0, 1, 4, ...Buffer.from("/a/b"), 7, 0xac, 0x02]);
  const publish = encodePublish("/a/b", "hi", { fields: { f: "v" }, closure: "c", publishId: "p1", guaranteed: true });
  assert.deepEqual([...publish], [0x04, 0x07, 1, 0x63, 2, 0x70, 0x31, 4, ...Buffer.from("/a/b"), 1, 1, 0x66, 1, 0x76, 0x68, 0x69]);
});

test("server messages decode, and malformed ones raise DecodeError only", () => {
  const message = Uint8Array.from([0x83, 0x0b, 4, ...Buffer.from("/a/b"), 0, 0x96, 0x01, 5, 0x78]);
  const frame = decodeServer(message);
  assert.equal(frame.op, "MESSAGE");
  assert.equal(frame.seq, 150);
  assert.equal(frame.epoch, 5);
  assert.equal(frame.snapshot, true);
  assert.equal(frame.recovered, true);
  assert.deepEqual([...frame.content], [0x78]);
  assert.deepEqual(decodeServer(Uint8Array.from([0x85, 2, 4, ...Buffer.from("/a/b")])), { op: "NOTIFY", code: "DATA_RESYNC", subject: "/a/b" });
  assert.deepEqual(decodeServer(Uint8Array.from([0x85, 3, 0])), { op: "NOTIFY", code: "KEEPALIVE", subject: "" });
  // protocol version 3: CONNECTED carries the server's keep-alive in ms
  const connected = decodeServer(Uint8Array.from([0x81, 3, 3, ...Buffer.from("1-2"), 5, 0x80, 0x08, 0xb8, 0x17]));
  assert.equal(connected.keepaliveMs, 3000);
  assert.equal(connected.maxMessageSize, 1024);
  for (const bad of [[], [0x7f], [0x83, 0], [0x84, 0, 9], [0x81, 2, 1, 0x41, 1, 1, 9], [0x82, 0, 2, 0xff, 0xfe, 0]]) {
    assert.throws(() => decodeServer(Uint8Array.from(bad)), DecodeError);
  }
  for (let n = 0; n < 500; n++) {
    const random = Uint8Array.from({ length: 1 + (n % 40) }, () => Math.floor(Math.random() * 256));
    try {
      decodeServer(random);
    } catch (error) {
      assert.ok(error instanceof DecodeError, String(error));
    }
  }
});

test("server lists take weights as the Python client does", () => {
  assert.deepEqual(parseServers(["100 ws://a:1", "ws://b:2", ["wss://c:3", 50]]), [
    { url: "ws://a:1", weight: 100 },
    { url: "ws://b:2", weight: 100 },
    { url: "wss://c:3", weight: 50 },
  ]);
  assert.throws(() => parseServers(["http://a"]), /ws:\/\//);
  assert.throws(() => parseServers([["ws://a", 0]]), /positive/);
  assert.throws(() => parseServers([]), /at least one/);
});

test("duplicates and older messages never reach the application", () => {
  const client = new MigratoryClient(["ws://127.0.0.1:1"], { reconnect: false });
  client.subscriptions.set("/a/b", 0);
  const got = [];
  client.onMessage = (m) => got.push(`${m.type}:${m.seq}`);
  const deliver = (seq, flags = 0) => client.handle(decodeServer(Uint8Array.from([0x83, flags, 4, ...Buffer.from("/a/b"), 0, seq, 1, 0x78])));
  deliver(3, 0x01); // snapshot at 3
  deliver(3);
  deliver(4);
  deliver(4);
  deliver(2);
  deliver(5, 0x08); // recovered
  client.handle({ op: "NOTIFY", code: "DATA_RESYNC", subject: "/a/b" });
  deliver(1, 0x01); // a resync snapshot may go back (the history restarted)
  deliver(2);
  assert.deepEqual(got, ["SNAPSHOT:3", "UPDATE:4", "RECOVERED:5", "SNAPSHOT:1", "UPDATE:2"]);
  assert.equal(client.duplicatesDropped, 3);
});

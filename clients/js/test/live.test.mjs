// The client against live servers: those tests/test_js_client.py started, or two started here (support/servers.mjs).
import assert from "node:assert/strict";
import test, { after, afterEach } from "node:test";

import { EventKind, MessageType, MigratoryClient, Status } from "../migratory.js";
import { liveServers } from "../support/servers.mjs";

const servers = await liveServers();
const URL = servers.url;
const BASIC = servers.basic;
const live = servers.skip ? (name, fn) => test(name, { skip: servers.skip }, fn) : test;
if (!servers.skip) after(servers.stop);

// Every client a test opens is closed after it, passed or failed: a failed assertion skips a test's own close(), and
// its open sockets (and reconnection timers) would keep this file's process alive past the caller's timeout.
const opened = [];
const open = (...args) => {
  const client = new MigratoryClient(...args);
  opened.push(client);
  return client;
};
afterEach(() => {
  for (const client of opened.splice(0)) client.close();
});

// Conflation periods are aligned to the clock (docs/protocol.md); wait until one has just begun, so that what a test
// publishes at once falls into one period however slow the machine is (the period being much longer than the burst).
const periodStart = async (periodMs) => {
  const into = Date.now() % periodMs;
  if (into > 50) await new Promise((resolve) => setTimeout(resolve, periodMs - into + 10));
};

live("subscribe: snapshot first, then updates, with fields; publish statuses", async () => {
  const events = [];
  const publisher = open([URL]);
  await publisher.connect();
  assert.equal(await publisher.publish("/js/a", "first", { fields: { volume: "6.62M" } }), Status.NO_SUBSCRIBER);
  const client = open([`100 ${URL}`], { onStatus: (e) => events.push(e) });
  await client.connect();
  assert.deepEqual(await client.subscribe(["/js/a", "bad subject"]), { "/js/a": Status.OK, "bad subject": Status.INVALID_SUBJECT });
  const snapshot = await client.nextMessage(5000);
  assert.equal(snapshot.type, MessageType.SNAPSHOT);
  assert.equal(snapshot.text, "first");
  assert.deepEqual(snapshot.fields, { volume: "6.62M" });
  assert.equal(await publisher.publish("/js/a", new TextEncoder().encode("second"), { fields: { ask: "190" } }), Status.OK);
  const update = await client.nextMessage(5000);
  assert.equal(update.type, MessageType.UPDATE);
  assert.equal(update.text, "second");
  assert.equal(update.seq, snapshot.seq + 1);
  const kinds = events.map((e) => e.kind);
  assert.ok(kinds.includes(EventKind.NOTIFY_SERVER_UP));
  assert.ok(events.some((e) => e.kind === EventKind.SUBSCRIBE_DENY && e.subject === "bad subject"));
  assert.ok(client.maxMessageSize > 0);
  assert.equal(await publisher.publish("/js/a", "x".repeat(client.maxMessageSize + 1)), Status.TOO_LARGE);
  client.close();
  publisher.close();
});

live("conflation and unsubscribe", async () => {
  const client = open([URL]);
  await client.connect();
  await client.subscribe(["/js/c"], { conflationMs: 2000 });
  const publisher = open([URL]);
  await publisher.connect();
  await periodStart(2000);
  for (let i = 0; i < 10; i++) await publisher.publish("/js/c", String(i), { fields: { [`f${i % 3}`]: String(i) } });
  const got = await client.nextMessage(5000);
  assert.equal(got.text, "9"); // one aggregate for the period: the latest content ...
  assert.deepEqual(got.fields, { f0: "9", f1: "7", f2: "8" }); // ... and the union of the fields
  client.unsubscribe(["/js/c"]);
  await publisher.publish("/js/c", "after");
  await assert.rejects(client.nextMessage(800));
  client.close();
  publisher.close();
});

live("entitlement: a publication without the token is denied, with it allowed", async () => {
  const anonymous = open([BASIC]);
  await anonymous.connect();
  assert.equal(await anonymous.publish("/js/e", "x"), Status.DENIED);
  const allowed = open([BASIC], { token: "js-secret-token" });
  await allowed.connect();
  assert.equal(await allowed.publish("/js/e", "x"), Status.NO_SUBSCRIBER);
  anonymous.close();
  allowed.close();
});

live("an unreachable server is reported down and the client tries again", async () => {
  const events = [];
  const client = open(["ws://127.0.0.1:9"], { onStatus: (e) => events.push(e), backoffInitial: 20, requestTimeout: 1000 });
  await assert.rejects(client.connect(600));
  await new Promise((resolve) => setTimeout(resolve, 1500));
  client.close();
  assert.ok(events.filter((e) => e.kind === EventKind.NOTIFY_SERVER_DOWN).length >= 2);
});

live("publishAll: a window of publications, each with its status, all delivered in order per subject", async () => {
  const subjects = Array.from({ length: 10 }, (_, i) => `/js/window/s${i}`);
  const client = open([URL]);
  await client.connect();
  await client.subscribe(subjects);
  const publisher = open([URL]);
  await publisher.connect();
  const total = 500;
  let outstanding = 0;
  let most = 0;
  async function* items() {  // an async source, counting what awaits its status when the next one is asked for
    for (let i = 0; i < total; i++) {
      most = Math.max(most, outstanding);
      outstanding += 1;
      yield { subject: subjects[i % subjects.length], content: String(i), fields: { n: String(i) } };
    }
  }
  const results = [];
  for await (const result of publisher.publishAll(items(), { window: 8 })) {
    outstanding -= 1;
    results.push(result);
  }
  assert.equal(results.length, total);
  assert.deepEqual(results.map((r) => r.index).sort((a, b) => a - b), Array.from({ length: total }, (_, i) => i));
  assert.ok(results.every((r) => r.status === Status.OK && r.ok && r.attempts === 1));
  assert.equal(new Set(results.map((r) => r.publishId)).size, total);
  assert.ok(most <= 8 && most >= 2, `at most 8 in flight, and more than one: ${most}`);
  const got = new Map();
  for (let i = 0; i < total; i++) {
    const m = await client.nextMessage(5000);
    got.set(m.subject, [...(got.get(m.subject) ?? []), Number(m.text)]);
  }
  for (const [subject, numbers] of got) assert.deepEqual(numbers, [...numbers].sort((a, b) => a - b), subject);
  // a bad one gets its own status among good ones; the rate spaces the sending
  const started = Date.now();
  const mixed = [];
  const batch = [{ subject: "/js/window/s0", content: "a" }, { subject: "bad subject", content: "b" }];
  for await (const r of publisher.publishAll([...batch, ...batch, ...batch, ...batch, ...batch], { window: 4, rate: 50 })) mixed.push(r);
  assert.ok(Date.now() - started >= 150, "10 publications at 50/s take about 0.2 s");
  assert.deepEqual(mixed.sort((a, b) => a.index - b.index).map((r) => r.status), Array.from({ length: 10 }, (_, i) => (i % 2 ? Status.INVALID_SUBJECT : Status.OK)));
  await assert.rejects(async () => { for await (const _ of publisher.publishAll([], { window: 0 })); }, RangeError);
});

live("HTTP streaming carries the same session (forced), across the workers of the node", async () => {
  const events = [];
  const client = open([URL], { transport: "http-stream", onStatus: (e) => events.push(e) });
  await client.connect();
  assert.equal(client.transportName, "http-stream");
  assert.deepEqual(await client.subscribe(["/js/stream"]), { "/js/stream": Status.OK });
  const publisher = open([URL]);
  await publisher.connect();
  for (let i = 0; i < 20; i++) assert.equal(await publisher.publish("/js/stream", `s${i}`), Status.OK);
  const got = [];
  for (let i = 0; i < 20; i++) got.push((await client.nextMessage(5000)).text);
  assert.deepEqual(got, Array.from({ length: 20 }, (_, i) => `s${i}`));
  // and it publishes through POSTs (some land on the other worker and are relayed)
  for (let i = 0; i < 10; i++) assert.equal(await client.publish("/js/stream", `own${i}`), Status.OK);
  for (let i = 0; i < 10; i++) assert.equal((await client.nextMessage(5000)).text, `own${i}`);
  assert.ok(events.some((e) => e.kind === EventKind.NOTIFY_SERVER_UP));
  client.close();
  publisher.close();
});

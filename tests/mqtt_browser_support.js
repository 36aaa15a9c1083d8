// The page side of tests/test_mqtt_browser.py: MQTT.js clients (the global `mqtt` of dist/mqtt.min.js), each
// under a name, what they receive and what happens to them, for the test to read with page.evaluate.
// Every call settles within a bound of its own: a test never hangs on a packet that does not come.
"use strict";

window.T = (() => {
  const clients = {};
  const inbox = {}; // name -> [{topic, payload, qos, retain, dup, userProperties}]
  const events = {}; // name -> ["close", "error: ...", "disconnect: 135", ...]
  const decoder = new TextDecoder();

  function bounded(promise, what, ms) {
    let timer;
    const timeout = new Promise((resolve) => {
      timer = setTimeout(() => resolve({ timeout: `no answer to ${what} within ${ms} ms` }), ms);
    });
    return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
  }

  function closed(name) {
    return new Promise((resolve) => clients[name].once("close", () => resolve({ closed: true })));
  }

  function describe(err) {
    if (!err) return null;
    return { message: String(err.message || err), code: err.code === undefined ? null : err.code };
  }

  return {
    inbox,
    events,

    // Resolves with the CONNACK's code and properties, or {error} / {timeout}. The page must come from a loopback
    // origin: Chromium blocks WebSockets to 127.0.0.1 from about:blank (ERR_BLOCKED_BY_LOCAL_NETWORK_ACCESS_CHECKS).
    connect(name, url, options, ms) {
      inbox[name] = [];
      events[name] = [];
      const client = mqtt.connect(url, { reconnectPeriod: 0, connectTimeout: ms, clean: true, ...options });
      clients[name] = client;
      client.on("message", (topic, payload, packet) => {
        const properties = packet.properties || {};
        inbox[name].push({
          topic,
          payload: decoder.decode(payload),
          qos: packet.qos,
          retain: packet.retain,
          dup: packet.dup,
          userProperties: properties.userProperties || null,
        });
      });
      client.on("close", () => events[name].push("close"));
      client.on("error", (err) => events[name].push(`error: ${err.message}`));
      client.on("disconnect", (packet) => events[name].push(`disconnect: ${packet.reasonCode}`));
      const connected = new Promise((resolve) => {
        client.once("connect", (connack) =>
          resolve({
            code: connack.reasonCode !== undefined ? connack.reasonCode : connack.returnCode,
            properties: connack.properties || null,
          }),
        );
        client.once("error", (err) => resolve({ error: describe(err) }));
        client.once("close", () => resolve({ error: { message: "closed before CONNACK", code: null } }));
      });
      return bounded(connected, `CONNECT of ${name}`, ms);
    },

    // Resolves with the SUBACK's codes (one per filter, in order; the packet MQTT.js passes as the callback's third
    // argument) and MQTT.js's error: it reports any code >= 0x80 as "Subscribe error: <reason>".
    subscribe(name, filters, ms) {
      const done = new Promise((resolve) => {
        clients[name].subscribe(filters, (err, granted, packet) => {
          const suback = packet || (err && err.packet) || null;
          resolve({
            error: describe(err),
            codes: suback ? Array.from(suback.granted) : null,
            granted: granted ? granted.map((g) => ({ topic: g.topic, qos: g.qos })) : null,
          });
        });
      });
      return bounded(Promise.race([done, closed(name)]), `SUBSCRIBE of ${name}`, ms);
    },

    // Resolves when the publication is acknowledged (QoS 1: the PUBACK; QoS 0: written), with MQTT.js's
    // error if the PUBACK carried a failure code, or {closed} if the server closed the connection instead.
    publish(name, topic, payload, options, ms) {
      const done = new Promise((resolve) => {
        clients[name].publish(topic, payload, options, (err, packet) => {
          resolve({ error: describe(err), reasonCode: packet && packet.reasonCode !== undefined ? packet.reasonCode : null });
        });
      });
      return bounded(Promise.race([done, closed(name)]), `PUBLISH of ${name} on ${topic}`, ms);
    },

    // A clean end: DISCONNECT (reason 0), then the connection closes.
    end(name, ms) {
      const done = new Promise((resolve) => clients[name].end(false, {}, () => resolve({ ended: true })));
      return bounded(done, `end of ${name}`, ms);
    },
  };
})();

// Live servers for the live tests: the ones tests/test_js_client.py started (MIGRATORY_WS_URL,
// MIGRATORY_BASIC_URL), or two started here with the `migratory` command (MIGRATORY_BIN, the
// repository's .venv/bin/migratory, or one on PATH), so that `npm test` works on its own.
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = dirname(fileURLToPath(import.meta.url));

function migratoryCommand() {
  const candidates = [process.env.MIGRATORY_BIN, join(HERE, "..", "..", "..", ".venv", "bin", "migratory")];
  for (const candidate of candidates) if (candidate && existsSync(candidate)) return candidate;
  const onPath = spawnSync("migratory", ["--help"], { stdio: "ignore" });
  return onPath.status === 0 ? "migratory" : null;
}

function freePort() {
  return new Promise((resolve, reject) => {
    const probe = createServer();
    probe.on("error", reject);
    probe.listen(0, "127.0.0.1", () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    });
  });
}

async function waitHealthy(url, child, seconds = 30) {
  const deadline = Date.now() + seconds * 1000;
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`the server exited with code ${child.exitCode}`);
    try {
      if ((await fetch(`${url}/health`)).status === 200) return;
    } catch {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`the server at ${url} was not ready within ${seconds} s`);
}

async function startOne(command, folder, name, extra) {
  const port = await freePort();
  const lines = [`Listen = 127.0.0.1:${port}`, `LogFolder = ${join(folder, name, "logs")}`,
    `StateFolder = ${join(folder, name, "state")}`, ...extra];
  const conf = join(folder, `${name}.conf`);
  writeFileSync(conf, lines.join("\n") + "\n");
  const child = spawn(command, ["serve", "-c", conf], { stdio: ["ignore", "ignore", "inherit"] });
  await waitHealthy(`http://127.0.0.1:${port}`, child);
  return { url: `ws://127.0.0.1:${port}`, child };
}

/** SIGTERM, then SIGKILL if the server has not exited within 15 s; resolves once it has exited. */
function stopped(child) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const kill = setTimeout(() => child.kill("SIGKILL"), 15000);
    child.once("exit", () => {
      clearTimeout(kill);
      resolve();
    });
    child.kill("SIGTERM");
  });
}

/** `{ url, basic, stop }` for the live tests, or `{ skip }`: one line saying how to run them. */
export async function liveServers() {
  if (process.env.MIGRATORY_WS_URL && process.env.MIGRATORY_BASIC_URL) {
    return { url: process.env.MIGRATORY_WS_URL, basic: process.env.MIGRATORY_BASIC_URL, stop: () => {} };
  }
  const command = migratoryCommand();
  if (command === null) {
    return { skip: "no `migratory` command: run `make venv` at the repository's root, or set MIGRATORY_BIN" };
  }
  const folder = mkdtempSync(join(tmpdir(), "migratory-js-"));
  const started = [];
  // the servers stop first (they write their logs and state as they go), then their folder goes: removed
  // under a server still shutting down it fails (ENOTEMPTY), and a server left behind would hold our stderr
  const stop = async () => {
    await Promise.all(started.map(({ child }) => stopped(child)));
    rmSync(folder, { recursive: true, force: true });
  };
  try {
    started.push(await startOne(command, folder, "plain", ["Workers = 2"]));
    started.push(await startOne(command, folder, "basic",
      ["Workers = 1", "Entitlement = Basic", "EntitlementAllowToken = js-secret-token"]));
  } catch (error) {
    await stop();
    throw error;
  }
  return { url: started[0].url, basic: started[1].url, stop };
}

// A missing or silent daemon is reported within the timeout, never a hang.
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { after, test } from "node:test";

import { Client, ClosedError, KvdTimeoutError } from "../src/index.js";

const TIMEOUT_MS = 400;
const dir = mkdtempSync(path.join(tmpdir(), "kvd-js-"));
after(() => rmSync(dir, { recursive: true, force: true }));

/** Run `call`, which must fail with a KvdTimeoutError of `code` after about TIMEOUT_MS. */
async function assertTimesOut(endpoint, code, call) {
  const client = new Client({ endpoint, timeoutMs: TIMEOUT_MS });
  const started = Date.now();
  try {
    const expected = (e) => e instanceof KvdTimeoutError && e.code === code && e.message.includes(endpoint);
    await assert.rejects(call(client), expected);
  } finally {
    client.close();
  }
  const elapsed = Date.now() - started;
  assert.ok(elapsed >= TIMEOUT_MS - 50 && elapsed < TIMEOUT_MS + 1500, `took ${elapsed} ms`);
}

test("no socket file: no_daemon after the timeout", async () => {
  await assertTimesOut(`ipc://${dir}/missing.sock`, "no_daemon", (c) => c.generate({ prompt: "Hi" }));
});

test("a socket path nobody listens on: timeout", async () => {
  const stale = path.join(dir, "stale.sock");
  writeFileSync(stale, ""); // what a crashed daemon leaves behind: a path that refuses connections
  await assertTimesOut(`ipc://${stale}`, "timeout", (c) => c.health());
});

test("a tcp port nobody listens on: timeout, streaming too", async () => {
  await assertTimesOut("tcp://127.0.0.1:9", "timeout", async (c) => {
    for await (const _chunk of c.stream({ prompt: "Hi" })) assert.fail("no chunk can arrive");
  });
});

test("a closed client refuses calls", async () => {
  const client = new Client({ endpoint: `ipc://${dir}/missing.sock`, timeoutMs: TIMEOUT_MS });
  const pending = client.health();
  client.close();
  await assert.rejects(pending, ClosedError);
  await assert.rejects(client.generate({ prompt: "Hi" }), ClosedError);
});

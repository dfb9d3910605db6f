// The client against a running daemon at $KVD_ENDPOINT (tests/test_js_client.py starts one on a tiny model).
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { after, before, test } from "node:test";

import { Client, DaemonError } from "../src/index.js";

const GREEDY = { temperature: 0, max_tokens: 12, ignore_eos: true };
let client;

before(async () => {
  assert.ok(process.env.KVD_ENDPOINT, "set KVD_ENDPOINT to a running daemon (tests/test_js_client.py does)");
  client = new Client({ timeoutMs: 20_000 }); // the default resolution: $KVD_ENDPOINT
  assert.deepEqual(await client.health(), { status: "ready" });
});
after(() => client.close());

async function collect(stream) {
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

function assertDaemonError(code, field) {
  return (e) => e instanceof DaemonError && e.code === code && (field === undefined || e.field === field);
}

test("streamed chunks concatenate to the non-streamed completion", async () => {
  const request = { prompt: "The capital of France is", ...GREEDY };
  const whole = await client.generate(request);
  assert.equal(whole.token_ids.length, 12);
  assert.equal(whole.finish_reason, "length");
  const chunks = await collect(client.stream(request));
  assert.ok(chunks.length > 1, "a 12-token stream comes in several chunks");
  assert.equal(chunks.map((c) => c.text).join(""), whole.text);
  assert.deepEqual(chunks.flatMap((c) => c.token_ids), whole.token_ids);
  const last = chunks.at(-1);
  assert.equal(last.finish_reason, "length");
  assert.deepEqual(last.usage, whole.usage);
  assert.ok(chunks.slice(0, -1).every((c) => c.finish_reason === null && c.usage === null));
});

test("concurrent requests on one client are routed by id", async () => {
  const prompts = ["Once upon a time", "The quick brown fox", "Hello"];
  const alone = [];
  for (const prompt of prompts) alone.push(await client.generate({ prompt, ...GREEDY }));
  const together = await Promise.all([
    ...prompts.map((prompt) => client.generate({ prompt, ...GREEDY })),
    ...prompts.map((prompt) => collect(client.stream({ prompt, ...GREEDY }))),
  ]);
  for (let i = 0; i < prompts.length; i++) {
    assert.deepEqual(together[i].token_ids, alone[i].token_ids);
    assert.deepEqual(together[i + prompts.length].flatMap((c) => c.token_ids), alone[i].token_ids);
  }
});

test("chat and streamed chat agree", async () => {
  const request = { messages: [{ role: "user", content: "Hi there" }], ...GREEDY };
  const whole = await client.chat(request);
  const chunks = await collect(client.streamChat(request));
  assert.deepEqual(chunks.flatMap((c) => c.token_ids), whole.token_ids);
  assert.equal(chunks.map((c) => c.text).join(""), whole.text);
});

test("tokenize and detokenize round-trip", async () => {
  const ids = await client.tokenize("Hello world");
  assert.ok(ids.length >= 2 && ids.every(Number.isInteger));
  assert.equal(await client.detokenize(ids), "Hello world");
  const completion = await client.generate({ prompt_token_ids: ids, ...GREEDY });
  assert.deepEqual(completion.token_ids, (await client.generate({ prompt: "Hello world", ...GREEDY })).token_ids);
});

test("a bad temperature is a bad_request naming the field, streaming or not", async () => {
  const badTemperature = assertDaemonError("bad_request", "temperature");
  await assert.rejects(client.generate({ prompt: "Hi", temperature: -1 }), badTemperature);
  await assert.rejects(collect(client.stream({ prompt: "Hi", temperature: 1000 })), badTemperature);
  const unknownField = assertDaemonError("bad_request", "temprature");
  await assert.rejects(client.generate({ prompt: "Hi", temprature: 0.5 }), unknownField);
});

test("a prompt longer than max_prompt_tokens is too_large", async () => {
  const limit = (await client.info()).limits.max_prompt_tokens;
  const ids = new Array(limit + 1).fill(1);
  await assert.rejects(client.generate({ prompt_token_ids: ids, max_tokens: 1 }), assertDaemonError("too_large"));
  // The connection stays usable after an error reply.
  assert.equal((await client.generate({ prompt: "Hi", ...GREEDY })).token_ids.length, 12);
});

test("abort ends a stream with finish_reason abort; aborting a finished request says false", async () => {
  const stream = client.stream({ prompt: "Once upon a time", temperature: 0, max_tokens: 4000, ignore_eos: true });
  const chunks = [];
  for await (const chunk of stream) {
    chunks.push(chunk);
    if (chunks.length === 2) assert.equal(await client.abort(stream.id), true);
  }
  const last = chunks.at(-1);
  assert.equal(last.finish_reason, "abort");
  assert.ok(last.usage.completion_tokens < 4000);
  assert.equal(await client.abort(stream.id), false);
});

test("leaving a for-await loop early aborts the generation in the daemon", async () => {
  const stream = client.stream({ prompt: "Hi", temperature: 0, max_tokens: 4000, ignore_eos: true });
  for await (const _chunk of stream) break;
  assert.equal(stream.done, true);
  const deadline = Date.now() + 5000;
  let stats = await client.stats();
  while (stats.num_running + stats.num_waiting > 0 && Date.now() < deadline) {
    await new Promise((resolve) => setTimeout(resolve, 50));
    stats = await client.stats();
  }
  assert.equal(stats.num_running + stats.num_waiting, 0);
});

test("info speaks protocol version 1", async () => {
  const info = await client.info();
  assert.equal(info.protocol_version, 1);
  assert.ok(info.supported_versions.includes(1));
});

test("a program that never calls close() still exits", () => {
  const script =
    'import { Client } from "./src/index.js";' +
    'const client = new Client();' +
    'const reply = await client.generate({ prompt: "Hi", max_tokens: 2 });' +
    "console.log(reply.token_ids.length);";
  const child = spawnSync(process.execPath, ["--input-type=module", "-e", script], {
    cwd: new URL("..", import.meta.url),
    encoding: "utf8",
    timeout: 10_000,
  });
  assert.equal(child.error, undefined, "the program did not exit within 10 s");
  assert.equal(child.status, 0, child.stderr);
  assert.equal(child.stdout.trim(), "2");
});

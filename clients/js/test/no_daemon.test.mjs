// A missing or silent daemon is reported within the timeout, never a hang; a stand-in daemon socket shows what
// goes on the wire.
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { after, test } from "node:test";

import { decode, encode } from "@msgpack/msgpack";
import { Router } from "zeromq";

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

/** A Router socket standing in for the daemon: each request map it gets is answered with reply(request). */
async function withFakeDaemon(reply, body) {
  const endpoint = `ipc://${dir}/fake-${Math.random().toString(36).slice(2)}.sock`;
  const router = new Router({ linger: 0 });
  await router.bind(endpoint);
  const requests = [];
  const serving = (async () => {
    for await (const [identity, frame] of router) {
      const request = decode(frame);
      requests.push(request);
      await router.send([identity, encode({ id: request.id, ...reply(request) })]);
    }
  })().catch(() => {}); // ends when the router closes
  const client = new Client({ endpoint, timeoutMs: 5000 });
  try {
    await body(client, requests);
  } finally {
    client.close();
    router.close();
    await serving;
  }
}

const FINAL = {
  type: "final",
  text: "",
  token_ids: [5, 6],
  finish_reason: "tool_calls",
  usage: { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 0 },
  prompt_logprobs: [null, { token_id: 9, logprob: -3.5, top_logprobs: [[1, -0.25]] }],
  tool_calls: [{ id: "call_a", type: "function", function: { name: "f", arguments: '{"a": 1}' } }],
};

test("structured output, logit_bias, tools and tool messages go out as the protocol's fields", async () => {
  const tools = [{ type: "function", function: { name: "f", parameters: { type: "object", properties: {} } } }];
  const messages = [
    { role: "user", content: "hi" },
    { role: "assistant", content: null, tool_calls: FINAL.tool_calls },
    { role: "tool", tool_call_id: "call_a", name: "f", content: "42" },
  ];
  await withFakeDaemon(
    () => FINAL,
    async (client, requests) => {
      const schema = { type: "object", properties: { n: { type: "integer", minimum: 1.5 } } };
      const reply = await client.chat({
        messages,
        tools,
        tool_choice: { type: "function", function: { name: "f" } },
        parallel_tool_calls: false,
        json_schema: schema,
        logit_bias: new Map([
          [5, -100],
          [17, 2.5],
        ]),
        prompt_logprobs: 1,
        regex: undefined,
      });
      assert.deepEqual(requests[0], {
        v: 1,
        id: requests[0].id,
        op: "chat",
        messages,
        tools,
        tool_choice: { type: "function", function: { name: "f" } },
        parallel_tool_calls: false,
        json_schema: schema,
        logit_bias: { 5: -100, 17: 2.5 },
        prompt_logprobs: 1,
      });
      assert.equal(reply.finish_reason, "tool_calls");
      assert.deepEqual(reply.tool_calls, FINAL.tool_calls);
      assert.deepEqual(reply.prompt_logprobs, FINAL.prompt_logprobs);
      await client.generate({ prompt: "Hi", regex: "a+", logit_bias: { 3: 1 } });
      assert.equal(requests[1].regex, "a+");
      assert.deepEqual(requests[1].logit_bias, { 3: 1 });
      const chunks = [];
      const stream = client.streamChat({ messages, tools, tool_choice: "required" });
      for await (const chunk of stream) chunks.push(chunk);
      assert.equal(requests[2].stream, true);
      assert.deepEqual(chunks.at(-1).tool_calls, FINAL.tool_calls);
    },
  );
});

test("chunks that are not the last have no tool_calls or prompt_logprobs", async () => {
  await withFakeDaemon(
    () => ({ ...FINAL, tool_calls: undefined, prompt_logprobs: undefined }),
    async (client) => {
      const reply = await client.generate({ prompt: "Hi" });
      assert.equal(reply.tool_calls, null);
      assert.equal(reply.prompt_logprobs, null);
    },
  );
});

test("embed sends input, dimensions and cache_salt and returns the result's fields", async () => {
  const result = {
    type: "result",
    embeddings: [
      [0.6, 0.8],
      [1, 0],
    ],
    dimensions: 2,
    pooling: "mean",
    usage: { prompt_tokens: 4 },
  };
  await withFakeDaemon(
    () => result,
    async (client, requests) => {
      const { type: _type, ...fields } = result;
      assert.deepEqual(await client.embed({ input: ["a", "b"], dimensions: 2, cache_salt: "s" }), fields);
      await client.embed("a");
      await client.embed([[1, 2, 3]]);
      const sent = requests.map(({ id: _id, ...rest }) => rest);
      assert.deepEqual(sent, [
        { v: 1, op: "embed", input: ["a", "b"], dimensions: 2, cache_salt: "s" },
        { v: 1, op: "embed", input: "a" },
        { v: 1, op: "embed", input: [[1, 2, 3]] },
      ]);
    },
  );
});

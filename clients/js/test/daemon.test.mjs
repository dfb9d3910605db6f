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

test("a BigInt seed past 2^53 goes out whole; a value msgpack cannot carry names its field", async () => {
  const big = { prompt: "Hi", temperature: 1, max_tokens: 8, seed: 2n ** 62n + 1n };
  const first = await client.generate(big);
  assert.deepEqual((await client.generate(big)).token_ids, first.token_ids); // the same seed, exactly
  const near = await client.generate({ ...big, seed: 2n ** 62n });
  assert.notDeepEqual(near.token_ids, first.token_ids); // not rounded to a neighbour, as a Number would be
  // A Number seed past 32 bits stays an integer on the wire (the same tokens as the BigInt of it).
  const asNumber = await client.generate({ ...big, seed: 2 ** 40 + 3 });
  assert.deepEqual(asNumber.token_ids, (await client.generate({ ...big, seed: 2n ** 40n + 3n })).token_ids);
  await assert.rejects(client.generate({ prompt: "Hi", seed: 2n ** 64n }), assertDaemonError("bad_request", "seed"));
  const cyclic = {};
  cyclic.self = cyclic;
  await assert.rejects(client.generate({ prompt: "Hi", json_schema: cyclic }), assertDaemonError("bad_request", "json_schema"));
  await assert.rejects(client.generate({ prompt: "Hi", stop: [Symbol("x")] }), assertDaemonError("bad_request", "stop"));
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

// Structured output, logit_bias, log-probabilities, tools and embed (the tiny model's weights are random, so
// only what the constraints guarantee is checked).

const WEATHER = {
  type: "object",
  properties: { city: { enum: ["Paris", "Oslo"] }, unit: { enum: ["c", "f"] } },
  required: ["city", "unit"],
  additionalProperties: false,
};
const TIME = {
  type: "object",
  properties: { zone: { enum: ["utc", "cet"] } },
  required: ["zone"],
  additionalProperties: false,
};
const TOOLS = [
  { type: "function", function: { name: "get_weather", description: "Weather now", parameters: WEATHER } },
  { type: "function", function: { name: "get_time", parameters: TIME } },
];
const ASK = [{ role: "user", content: "What is the weather in Paris?" }];

/** Every call names one of `names` and its arguments hold exactly the schema's enum-valued properties. */
function assertValidCalls(reply, names) {
  assert.equal(reply.finish_reason, "tool_calls");
  assert.equal(reply.text, "");
  assert.ok(reply.tool_calls.length >= 1);
  for (const call of reply.tool_calls) {
    assert.ok(call.id.startsWith("call_") && call.type === "function", JSON.stringify(call));
    assert.ok(names.includes(call.function.name), call.function.name);
    const schema = call.function.name === "get_weather" ? WEATHER : TIME;
    const args = JSON.parse(call.function.arguments);
    for (const name of schema.required) {
      assert.ok(schema.properties[name].enum.includes(args[name]), call.function.arguments);
    }
    for (const name of Object.keys(args)) assert.ok(name in schema.properties, call.function.arguments);
  }
}

test("regex, json_schema, grammar and json_object constrain the output", async () => {
  const schema = {
    type: "object",
    properties: { ok: { type: "boolean" }, color: { enum: ["red", "green", "blue"] } },
    required: ["ok", "color"],
    additionalProperties: false,
  };
  for (let seed = 0; seed < 3; seed++) {
    const sampled = { temperature: 1, seed, max_tokens: 64 };
    for (const input of [{ prompt: "Name a number:" }, { messages: ASK }]) {
      const call = (request) => ("messages" in request ? client.chat(request) : client.generate(request));
      const byRegex = await call({ ...input, ...sampled, regex: "[a-z]{2,6}-[0-9]{1,3}" });
      assert.match(byRegex.text, /^[a-z]{2,6}-[0-9]{1,3}$/);
      assert.equal(byRegex.finish_reason, "stop");
      // The schema as a map, and as JSON text, which the protocol also allows.
      for (const jsonSchema of [schema, JSON.stringify(schema)]) {
        const bySchema = await call({ ...input, ...sampled, json_schema: jsonSchema });
        assert.equal(bySchema.finish_reason, "stop");
        const value = JSON.parse(bySchema.text);
        assert.deepEqual(Object.keys(value).sort(), ["color", "ok"]);
        assert.equal(typeof value.ok, "boolean");
        assert.ok(schema.properties.color.enum.includes(value.color));
      }
      const byGrammar = await call({ ...input, ...sampled, grammar: 'start: "yes" | "no"' });
      assert.ok(["yes", "no"].includes(byGrammar.text) && byGrammar.finish_reason === "stop", byGrammar.text);
    }
  }
  const chunks = await collect(client.stream({ prompt: "Hi", temperature: 0, max_tokens: 24, json_object: true }));
  const text = chunks.map((c) => c.text).join("");
  assert.ok(text.startsWith("{"), text);
  if (chunks.at(-1).finish_reason === "stop") assert.equal(typeof JSON.parse(text), "object");
});

test("an invalid regex, schema or grammar is a bad_request naming the field", async () => {
  const cases = [
    [{ regex: "(unclosed" }, "regex"],
    [{ json_schema: { type: "nope" } }, "json_schema"],
    [{ json_schema: "{not json" }, "json_schema"],
    [{ grammar: "start: ::" }, "grammar"],
    [{ prompt_logprobs: 99 }, "prompt_logprobs"],
  ];
  for (const [bad, field] of cases) {
    await assert.rejects(client.generate({ prompt: "Hi", ...bad }), assertDaemonError("bad_request", field));
    const streamed = collect(client.stream({ prompt: "Hi", ...bad }));
    await assert.rejects(streamed, assertDaemonError("bad_request", field));
  }
  const twoConstraints = { prompt: "Hi", regex: "a", grammar: 'start: "a"' };
  const badRequest = (e) => e instanceof DaemonError && e.code === "bad_request" && e.field !== null;
  await assert.rejects(client.generate(twoConstraints), badRequest);
  assert.equal((await client.generate({ prompt: "Hi", ...GREEDY })).token_ids.length, 12); // still serving
});

test("logit_bias bans and forces tokens", async () => {
  const request = { prompt: "The capital of France is", temperature: 0, max_tokens: 4, ignore_eos: true };
  const plain = await client.generate(request);
  const first = plain.token_ids[0];
  const banned = await client.generate({ ...request, logit_bias: { [first]: -100 } });
  assert.ok(!banned.token_ids.includes(first), JSON.stringify([plain.token_ids, banned.token_ids]));
  const forced = await client.generate({ ...request, logit_bias: new Map([[504, 100]]) });
  assert.deepEqual(forced.token_ids, [504, 504, 504, 504]);
});

test("logprobs and prompt_logprobs", async () => {
  const promptIds = await client.tokenize("The capital of France is");
  const request = { prompt: "The capital of France is", ...GREEDY, logprobs: 2, prompt_logprobs: 3 };
  const whole = await client.generate(request);
  assert.deepEqual(whole.logprobs.map((e) => e.token_id), whole.token_ids);
  for (const entry of whole.logprobs) assert.equal(entry.top_logprobs[0][0], entry.token_id); // greedy
  assert.equal(whole.prompt_logprobs.length, promptIds.length);
  assert.equal(whole.prompt_logprobs[0], null);
  assert.deepEqual(whole.prompt_logprobs.slice(1).map((e) => e.token_id), promptIds.slice(1));
  const chunks = await collect(client.stream(request));
  assert.deepEqual(chunks.flatMap((c) => c.logprobs), whole.logprobs);
  assert.deepEqual(chunks.at(-1).prompt_logprobs, whole.prompt_logprobs);
  assert.ok(chunks.slice(0, -1).every((c) => c.prompt_logprobs === null));
});

test("tool_choice required and a named function always give calls that parse", async () => {
  // Bounded schemas and one call each: the forced output always completes, so it always parses. (Parallel
  // calls may go on until max_tokens cuts them, and then the text is incomplete: the protocol's "length".)
  for (let seed = 0; seed < 3; seed++) {
    const request = { messages: ASK, tools: TOOLS, tool_choice: "required", temperature: 1, seed };
    Object.assign(request, { max_tokens: 200, parallel_tool_calls: false });
    const whole = await client.chat(request);
    assertValidCalls(whole, ["get_weather", "get_time"]);
    const chunks = await collect(client.streamChat(request));
    assert.equal(chunks.map((c) => c.text).join(""), "");
    const functions = (calls) => calls.map((c) => c.function);
    assert.deepEqual(functions(chunks.at(-1).tool_calls), functions(whole.tool_calls));
    assert.equal(whole.tool_calls.length, 1);
  }
  const named = await client.chat({
    messages: ASK,
    tools: TOOLS,
    tool_choice: { type: "function", function: { name: "get_time" } },
    parallel_tool_calls: false,
    temperature: 0,
    max_tokens: 120,
  });
  assertValidCalls(named, ["get_time"]);
  assert.equal(named.tool_calls.length, 1);
});

test("a tool conversation: calls go back as an assistant turn, results as tool messages", async () => {
  const greedy = { temperature: 0, max_tokens: 120 };
  const once = { tools: TOOLS, tool_choice: "required", parallel_tool_calls: false };
  const first = await client.chat({ messages: ASK, ...once, ...greedy });
  const call = first.tool_calls[0];
  const history = [
    ...ASK,
    { role: "assistant", content: null, tool_calls: [call] },
    { role: "tool", tool_call_id: call.id, content: '{"temp": 21}' },
  ];
  const rendered = await client.detokenize(await client.tokenize({ messages: history }));
  assert.ok(rendered.includes(call.function.name) && rendered.includes('{"temp": 21}'), rendered);
  const answer = { messages: history, tools: TOOLS, tool_choice: "none", ...greedy, max_tokens: 8 };
  const reply = await client.chat(answer);
  assert.ok(["stop", "length"].includes(reply.finish_reason));
  assert.ok(!reply.tool_calls?.length, JSON.stringify(reply.tool_calls));
  const unanswered = [...ASK, { role: "tool", tool_call_id: "call_x", content: "r" }];
  await assert.rejects(
    client.chat({ messages: unanswered, tools: TOOLS }),
    assertDaemonError("bad_request", "messages[1].tool_call_id"),
  );
  const badParameters = { type: "object", properties: { a: { type: "nope" } } };
  const badTool = { type: "function", function: { name: "f", parameters: badParameters } };
  await assert.rejects(
    client.chat({ messages: ASK, tools: [badTool] }),
    assertDaemonError("bad_request", "tools[0].function.parameters"),
  );
});

test("embed: normalised vectors per input, dimensions, token-id inputs, bad inputs", async () => {
  const info = await client.info();
  const texts = ["Hello world", "The capital of France is"];
  const result = await client.embed({ input: texts });
  assert.equal(result.embeddings.length, 2);
  assert.equal(result.dimensions, info.hidden_size);
  assert.equal(result.pooling, info.pooling);
  assert.ok(result.usage.prompt_tokens > 0);
  const norm = (v) => Math.sqrt(v.reduce((sum, x) => sum + x * x, 0));
  for (const vector of result.embeddings) {
    assert.equal(vector.length, info.hidden_size);
    assert.ok(Math.abs(norm(vector) - 1) < 1e-4);
  }
  // One input alone gives the same vector: embeddings do not depend on what else runs.
  const alone = await client.embed(texts[1]);
  alone.embeddings[0].forEach((x, i) => assert.ok(Math.abs(x - result.embeddings[1][i]) < 1e-5));
  const ids = await client.tokenize(texts[0]);
  const short = await client.embed({ input: [ids], dimensions: 8 });
  assert.equal(short.dimensions, 8);
  assert.equal(short.embeddings[0].length, 8);
  assert.ok(Math.abs(norm(short.embeddings[0]) - 1) < 1e-4);
  await assert.rejects(client.embed(["ok", ""]), assertDaemonError("bad_request", "input[1]"));
  const badDimensions = client.embed({ input: "a", dimensions: 0 });
  await assert.rejects(badDimensions, assertDaemonError("bad_request", "dimensions"));
});

// Runs one generation and prints what happened as one JSON object, for tests/test_js_client.py to compare
// with the Python client (and with the C client, which prints the same shape).
//
//   node tools/request.mjs ENDPOINT TIMEOUT_MS generate|stream|chat|stream_chat REQUEST_JSON
import { Client, KvdError } from "../src/index.js";

const [endpoint, timeoutMs, mode, requestJson] = process.argv.slice(2);
const request = JSON.parse(requestJson);
const client = new Client({ endpoint, timeoutMs: Number(timeoutMs) });
const started = Date.now();
const out = { endpoint: client.endpoint.url, status: "ok", chunks: [] };
try {
  let final;
  if (mode === "generate" || mode === "chat") {
    final = await client[mode](request);
  } else {
    const stream = mode === "stream" ? client.stream(request) : client.streamChat(request);
    for await (const chunk of stream) out.chunks.push(chunk);
    final = {
      ...out.chunks.at(-1),
      text: out.chunks.map((c) => c.text).join(""),
      token_ids: out.chunks.flatMap((c) => c.token_ids),
    };
  }
  const { text, token_ids, finish_reason, usage } = final;
  Object.assign(out, { text, token_ids, finish_reason, usage });
} catch (e) {
  if (!(e instanceof KvdError)) throw e;
  Object.assign(out, { status: e.code, code: e.code, field: e.field ?? "", message: e.message });
} finally {
  client.close();
}
out.elapsed_ms = Date.now() - started;
console.log(JSON.stringify(out));
process.exitCode = out.status === "ok" ? 0 : 1;

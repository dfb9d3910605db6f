// Complete a prompt with the kvd daemon, streaming the text to stdout. Ctrl-C stops the generation.
//
//   node examples/generate.mjs [--endpoint URL] [--max-tokens N] [--temperature T] [--timeout-ms MS] PROMPT...
import { parseArgs } from "node:util";

import { Client, KvdError } from "../src/index.js";

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    endpoint: { type: "string" },
    "max-tokens": { type: "string", default: "256" },
    temperature: { type: "string" },
    "timeout-ms": { type: "string", default: "30000" },
  },
});
if (positionals.length === 0) {
  console.error("usage: generate.mjs [--endpoint URL] [--max-tokens N] [--temperature T] [--timeout-ms MS] PROMPT");
  process.exit(2);
}

const client = new Client({ endpoint: values.endpoint, timeoutMs: Number(values["timeout-ms"]) });
const stream = client.stream({
  prompt: positionals.join(" "),
  max_tokens: Number(values["max-tokens"]),
  temperature: values.temperature === undefined ? undefined : Number(values.temperature),
});
// The daemon ends an aborted generation with finish_reason "abort", which ends the loop below.
process.on("SIGINT", () => client.abort(stream.id).catch(() => {}));
try {
  for await (const chunk of stream) {
    process.stdout.write(chunk.text);
    if (chunk.finish_reason !== null) {
      process.stdout.write("\n");
      if (chunk.finish_reason === "abort") console.error(`aborted after ${chunk.usage.completion_tokens} tokens`);
    }
  }
} catch (e) {
  if (!(e instanceof KvdError)) throw e;
  console.error(`generate: ${e.code}: ${e.message}`);
  process.exitCode = 1;
} finally {
  client.close();
}

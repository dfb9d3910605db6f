// Complete a prompt with the kvd daemon, streaming the text to stdout. Ctrl-C stops the generation.
//
//   node examples/generate.mjs [--endpoint URL] [--max-tokens N] [--temperature T] [--timeout-ms MS] PROMPT...
import { parseArgs } from "node:util";

import { Client, KvdError } from "../src/index.js";

const USAGE = "usage: generate.mjs [--endpoint URL] [--max-tokens N] [--temperature T] [--timeout-ms MS] PROMPT";

function usage(problem) {
  console.error(problem ? `generate: ${problem}\n${USAGE}` : USAGE);
  process.exit(problem ? 2 : 0);
}

let parsed;
try {
  parsed = parseArgs({
    allowPositionals: true,
    options: {
      endpoint: { type: "string" },
      "max-tokens": { type: "string", default: "256" },
      temperature: { type: "string" },
      "timeout-ms": { type: "string", default: "30000" },
      help: { type: "boolean", short: "h" },
    },
  });
} catch (e) {
  usage(e.message);
}
const { values, positionals } = parsed;
if (values.help) usage();
if (positionals.length === 0) usage("a prompt is required");

/** The flag's value as a number (a whole one if `whole`), or the usage and exit status 2. */
function number(flag, whole) {
  const text = values[flag];
  if (text === undefined) return undefined;
  const value = Number(text);
  if (text.trim() === "" || !Number.isFinite(value) || (whole && !Number.isInteger(value))) {
    usage(`--${flag} takes a ${whole ? "whole " : ""}number, got '${text}'`);
  }
  return value;
}

const client = new Client({ endpoint: values.endpoint, timeoutMs: number("timeout-ms", true) });
const stream = client.stream({
  prompt: positionals.join(" "),
  max_tokens: number("max-tokens", true),
  temperature: number("temperature", false),
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

// The wire format on the client side: request maps out, typed results back (see docs/protocol.md).
import { decode, encode } from "@msgpack/msgpack";

import { DaemonError, ProtocolError } from "./errors.js";

export const PROTOCOL_VERSION = 1;

/**
 * One request map; fields that are null or undefined are left out, so the daemon applies its defaults. A BigInt
 * goes out as a 64-bit integer (a seed past 2^53); a value msgpack cannot carry throws a bad_request DaemonError
 * naming the field, as the daemon would.
 */
export function packRequest(op, id, fields) {
  const message = { v: PROTOCOL_VERSION, id, op };
  for (const [key, value] of Object.entries(fields)) {
    if (value !== null && value !== undefined && !(key in message)) message[key] = value;
  }
  for (const [key, value] of Object.entries(message)) {
    try {
      message[key] = forWire(value);
    } catch (e) {
      throw new DaemonError("bad_request", `cannot be sent: ${e.message}`, key, id);
    }
  }
  try {
    return encode(message, WIRE);
  } catch (e) {
    // Only now, on the way out: the field the encoder refused (a Symbol, a function).
    const key = Object.keys(message).find((k) => !encodes(message[k])) ?? null;
    throw new DaemonError("bad_request", `cannot be sent: ${e.message}`, key, id);
  }
}

function encodes(value) {
  try {
    encode(value, WIRE);
    return true;
  } catch {
    return false;
  }
}

// BigInts as msgpack's 64-bit integers. With this option the encoder writes a Number integer past 32 bits as a
// float, which the daemon refuses where it takes an integer: forWire makes those BigInts too.
const WIRE = { useBigInt64: true };

/** `value` as the encoder must see it: integers past 32 bits as BigInts; a BigInt past 64 bits (which the
 * encoder would wrap around silently) throws. */
function forWire(value) {
  if (typeof value === "number") {
    return Number.isSafeInteger(value) && (value > 0xffffffff || value < -0x80000000) ? BigInt(value) : value;
  }
  if (typeof value === "bigint") {
    if (value < -(2n ** 63n) || value >= 2n ** 64n) throw new RangeError(`${value} is beyond 64-bit integers`);
    return value;
  }
  if (Array.isArray(value)) return value.map(forWire);
  if (value instanceof Map) return new Map([...value].map(([k, v]) => [k, forWire(v)]));
  if (value !== null && typeof value === "object" && !ArrayBuffer.isView(value)) {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, forWire(v)]));
  }
  return value;
}

export function unpackReply(data) {
  let reply;
  try {
    reply = decode(data);
  } catch (e) {
    throw new ProtocolError(`the daemon sent a reply that is not msgpack: ${e.message}`);
  }
  if (reply === null || typeof reply !== "object" || Array.isArray(reply) || typeof reply.type !== "string") {
    throw new ProtocolError(`the daemon sent a reply without a type: ${JSON.stringify(reply)?.slice(0, 200)}`);
  }
  return reply;
}

/** Throw the DaemonError of an error reply; return any other reply unchanged. */
function checkError(reply) {
  if (reply.type === "error") {
    throw new DaemonError(String(reply.code), String(reply.message ?? ""), reply.field ?? null, reply.id ?? null);
  }
  return reply;
}

/** The payload of a `result` reply (everything but `id` and `type`). */
export function toResult(reply) {
  checkError(reply);
  if (reply.type !== "result") throw new ProtocolError(`expected a result reply, got '${reply.type}'`);
  const { id: _id, type: _type, ...fields } = reply;
  return fields;
}

/**
 * One streamed increment: {id, text, token_ids, logprobs, finish_reason, usage, tool_calls, prompt_logprobs}.
 * The last chunk of a stream has finish_reason ("stop", "length", "tool_calls" or "abort") and usage set; the
 * others have them null. tool_calls (the protocol's [{id, type, function: {name, arguments}}], arguments as
 * JSON text) and prompt_logprobs (one entry per prompt token, null for the first) come with the last chunk
 * only, when they apply; they are null otherwise.
 */
export function toChunk(reply) {
  checkError(reply);
  if (reply.type !== "chunk" && reply.type !== "final") {
    throw new ProtocolError(`expected a chunk or final reply, got '${reply.type}'`);
  }
  if (typeof reply.text !== "string" || !Array.isArray(reply.token_ids)) {
    throw new ProtocolError(`the daemon sent a '${reply.type}' reply without text and token_ids`);
  }
  const final = reply.type === "final";
  return {
    id: reply.id,
    text: reply.text,
    token_ids: reply.token_ids,
    logprobs: reply.logprobs ?? null,
    finish_reason: final ? reply.finish_reason : null,
    usage: final ? reply.usage : null,
    tool_calls: final ? (reply.tool_calls ?? null) : null,
    prompt_logprobs: final ? (reply.prompt_logprobs ?? null) : null,
  };
}

/** A whole generation: {id, text, token_ids, logprobs, finish_reason, usage, tool_calls, prompt_logprobs}. */
export function toCompletion(reply) {
  checkError(reply);
  if (reply.type !== "final") throw new ProtocolError(`expected a final reply, got '${reply.type}'`);
  return toChunk(reply);
}

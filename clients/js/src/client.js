// The client: one DEALER socket to the daemon, a reader that routes replies to their request by id.
import { existsSync } from "node:fs";

import { Dealer } from "zeromq";

import { isIpv6, resolveEndpoint } from "./endpoint.js";
import { ClosedError, DaemonError, KvdError, KvdTimeoutError } from "./errors.js";
import { packRequest, toChunk, toCompletion, toResult, unpackReply } from "./wire.js";

export const DEFAULT_TIMEOUT_MS = 30_000;
// A pending receive keeps Node's event loop alive, so the reader stops when it has been idle this long with
// no request in flight: a program that forgets close() still exits.
const READER_IDLE_MS = 250;

/** Replies of one request, in order, and the caller waiting for the next one. */
class Inbox {
  items = [];
  waiter = null;

  /** A reply, or an Error that the waiting call throws. */
  push(item) {
    if (this.waiter === null) {
      this.items.push(item);
      return;
    }
    const waiter = this.waiter;
    this.waiter = null;
    waiter(item);
  }
}

/**
 * A connection to the kvd daemon.
 *
 * Any number of calls and streams may be in flight at once; their replies are routed by request id.
 * `timeoutMs` bounds how long a call waits while the daemon says nothing: the daemon sends a heartbeat every
 * second to a client with requests in flight, so a long generation never times out while the daemon lives,
 * and a dead or missing daemon is reported within `timeoutMs`. close() releases the socket (a program that
 * forgets it still exits).
 *
 * Requests are objects with the protocol's fields: `{prompt: "Hi", max_tokens: 8, temperature: 0}`.
 */
export class Client {
  #socket;
  #inboxes = new Map();
  #nextId = 1;
  #lastHeard = 0;
  #sending = Promise.resolve();
  #reader = null;
  #closed = false;

  constructor({ endpoint, timeoutMs = DEFAULT_TIMEOUT_MS } = {}) {
    if (!(timeoutMs > 0)) throw new RangeError(`timeoutMs must be > 0, got ${timeoutMs}`);
    this.endpoint = resolveEndpoint(endpoint);
    this.timeoutMs = timeoutMs;
    // sendTimeout: a send that the daemon does not take (a full queue) fails instead of hanging.
    this.#socket = new Dealer({
      linger: 0,
      ipv6: isIpv6(this.endpoint),
      sendTimeout: timeoutMs,
      receiveTimeout: READER_IDLE_MS,
    });
    this.#socket.connect(this.endpoint.url);
  }

  /** Complete `request.prompt` (or `request.prompt_token_ids`). A string is taken as the prompt. */
  async generate(request) {
    return this.#complete("generate", promptFields(request));
  }

  /** `for await (const chunk of client.stream({...}))`; leaving the loop early aborts the generation. */
  stream(request) {
    return new Stream(this, "generate", { ...promptFields(request), stream: true });
  }

  /**
   * The assistant's reply to `request.messages` ([{role, content}]); the daemon applies the chat template.
   * With `tools` (the protocol's tool maps), the calls the model made are the reply's `tool_calls`; pass them
   * back as an assistant message's `tool_calls`, and answer each with a `{role: "tool", tool_call_id, content}`.
   */
  async chat(request) {
    return this.#complete("chat", fields(request));
  }

  streamChat(request) {
    return new Stream(this, "chat", { ...fields(request), stream: true });
  }

  /**
   * Embedding vectors of `request.input`: a string, an array of strings, or an array of token-id arrays (a
   * bare string or array is taken as the input). `{input, dimensions, cache_salt}`; returns
   * `{embeddings, dimensions, pooling, usage}`, one L2-normalised array of numbers per input, in order.
   */
  async embed(request) {
    const bare = typeof request === "string" || Array.isArray(request);
    return this.#call("embed", bare ? { input: request } : fields(request));
  }

  /** Token ids of `{text}` as a prompt, or of `{messages}` with the chat template applied. */
  async tokenize(request) {
    return (await this.#call("tokenize", typeof request === "string" ? { text: request } : request)).token_ids;
  }

  async detokenize(tokenIds) {
    return (await this.#call("detokenize", { token_ids: Array.from(tokenIds) })).text;
  }

  /** Abort a generation of this client; false if it is not in flight (finished or unknown). */
  async abort(requestId) {
    try {
      await this.#call("abort", { target: requestId });
      return true;
    } catch (e) {
      if (e instanceof DaemonError && e.code === "not_found") return false;
      throw e;
    }
  }

  /** {status: "ready"} once the daemon serves; "draining" while it shuts down. */
  async health() {
    return this.#call("health", {});
  }

  async info() {
    return this.#call("info", {});
  }

  async stats() {
    return this.#call("stats", {});
  }

  close() {
    if (this.#closed) return;
    this.#closed = true;
    for (const inbox of this.#inboxes.values()) inbox.push(new ClosedError("the Client was closed"));
    this.#inboxes.clear();
    this.#socket.close();
  }

  get closed() {
    return this.#closed;
  }

  async #complete(op, requestFields) {
    const id = this._register();
    try {
      await this._send(op, id, requestFields);
      return toCompletion(await this._next(id));
    } catch (e) {
      // Timed out or broken: do not leave the daemon generating for nobody. An error reply ended it already.
      if (!(e instanceof DaemonError)) this._abortQuietly(id);
      throw e;
    } finally {
      this._finish(id);
    }
  }

  async #call(op, requestFields) {
    const id = this._register();
    try {
      await this._send(op, id, requestFields);
      return toResult(await this._next(id));
    } finally {
      this._finish(id);
    }
  }

  // The methods below are shared with Stream; they are not part of the API.

  _newId() {
    return this.#nextId++;
  }

  _register(id = this._newId()) {
    if (this.#closed) throw new ClosedError("this Client is closed; create a new one");
    this.#inboxes.set(id, new Inbox());
    return id;
  }

  _finish(id) {
    // A call still waiting (a stream closed while its next() is pending) learns that nothing will come.
    this.#inboxes.get(id)?.push(new ClosedError(`request ${id} was closed`));
    this.#inboxes.delete(id);
  }

  async _send(op, id, requestFields) {
    this.#reader ??= this.#read();
    const data = packRequest(op, id, requestFields);
    // zeromq.js allows one pending send per socket: chain them.
    const sent = this.#sending.then(() => this.#socket.send(data));
    this.#sending = sent.catch(() => {});
    try {
      await sent;
    } catch (e) {
      if (this.#closed) throw new ClosedError("the Client was closed");
      if (e.code === "EAGAIN") throw this.#timeoutError();
      throw new KvdError(`cannot send to the kvd daemon at ${this.endpoint.url}: ${e.message}`, "zmq");
    }
  }

  /** The next reply for `id`; rejects after `timeoutMs` without a word from the daemon. */
  _next(id) {
    const inbox = this.#inboxes.get(id);
    if (inbox === undefined) return Promise.reject(new ClosedError("the Client was closed"));
    if (inbox.items.length > 0) return settle(inbox.items.shift());
    const started = Date.now();
    return new Promise((resolve, reject) => {
      let timer;
      const check = () => {
        const quiet = Date.now() - Math.max(started, this.#lastHeard);
        if (quiet >= this.timeoutMs) {
          inbox.waiter = null;
          reject(this.#timeoutError());
        } else {
          timer = setTimeout(check, this.timeoutMs - quiet); // heard something meanwhile: wait on
        }
      };
      inbox.waiter = (item) => {
        clearTimeout(timer);
        settle(item).then(resolve, reject);
      };
      check();
    });
  }

  _abortQuietly(id) {
    if (this.#closed) return;
    // Best effort: a daemon that cannot take the abort cannot take anything else either.
    this._send("abort", this._newId(), { target: id }).catch(() => {});
  }

  /**
   * Route every reply to the inbox of its request; heartbeats only refresh the liveness clock. Runs while
   * requests are in flight; the next send starts it again.
   */
  async #read() {
    while (!this.#closed) {
      let frames;
      try {
        frames = await this.#socket.receive();
      } catch (e) {
        if (this.#closed) return;
        if (e.code === "EAGAIN") {
          if (this.#inboxes.size > 0) continue; // quiet for READER_IDLE_MS; _next judges the silence
          this.#reader = null;
          return;
        }
        const error = new KvdError(`cannot receive from the kvd daemon: ${e.message}`, "zmq");
        for (const inbox of this.#inboxes.values()) inbox.push(error);
        this.#reader = null;
        return;
      }
      this.#lastHeard = Date.now();
      let reply;
      try {
        reply = unpackReply(frames[0]);
      } catch (e) {
        for (const inbox of this.#inboxes.values()) inbox.push(e);
        continue;
      }
      // Else a heartbeat, or a late reply for an abandoned request or an abort: nothing waits for it.
      if (reply.type !== "heartbeat") this.#inboxes.get(reply.id)?.push(reply);
    }
  }

  #timeoutError() {
    const { url, transport, path } = this.endpoint;
    const seconds = this.timeoutMs / 1000;
    if (transport === "ipc" && !existsSync(path)) {
      return new KvdTimeoutError(
        `no kvd daemon at ${url}: the socket file does not exist after ${seconds} s; start \`kvd serve\` ` +
          "(or choose the endpoint: new Client({endpoint}) or $KVD_ENDPOINT)",
        "no_daemon",
      );
    }
    return new KvdTimeoutError(
      `no reply from the kvd daemon at ${url} within ${seconds} s: is \`kvd serve\` running there? ` +
        "(choose the endpoint: new Client({endpoint}) or $KVD_ENDPOINT)",
      "timeout",
    );
  }
}

/**
 * Chunks of one streamed generation, in order; the last carries finish_reason and usage. The request is sent
 * at the first iteration; `id` is its request id (for client.abort). Leaving a `for await` loop early (break,
 * throw) or calling close() aborts an unfinished generation.
 */
export class Stream {
  #client;
  #op;
  #fields;
  #sent = false;

  constructor(client, op, requestFields) {
    this.#client = client;
    this.#op = op;
    this.#fields = requestFields;
    this.id = client._newId();
    this.done = false;
  }

  [Symbol.asyncIterator]() {
    return this;
  }

  async next() {
    if (this.done) return { done: true, value: undefined };
    let chunk;
    try {
      if (!this.#sent) {
        this.#client._register(this.id);
        this.#sent = true;
        await this.#client._send(this.#op, this.id, this.#fields);
      }
      chunk = toChunk(await this.#client._next(this.id));
    } catch (e) {
      if (e instanceof DaemonError) this.#end();
      else this.close();
      throw e;
    }
    if (chunk.finish_reason !== null) this.#end();
    return { done: false, value: chunk };
  }

  async return() {
    this.close();
    return { done: true, value: undefined };
  }

  /** Stop reading; an unfinished generation is aborted in the daemon. */
  close() {
    if (this.done) return;
    if (this.#sent) this.#client._abortQuietly(this.id);
    this.#end();
  }

  #end() {
    this.done = true;
    this.#client._finish(this.id);
  }
}

function settle(item) {
  return item instanceof Error ? Promise.reject(item) : Promise.resolve(item);
}

function fields(request) {
  if (request === null || typeof request !== "object") {
    throw new TypeError("a request is an object with the protocol's fields, e.g. {prompt, max_tokens}");
  }
  const { stream: _stream, ...rest } = request; // generate and stream decide that
  if (rest.logit_bias instanceof Map) {
    // A Map may have number keys; the protocol's keys are token ids in decimal (an object's keys are already).
    rest.logit_bias = Object.fromEntries([...rest.logit_bias].map(([token, bias]) => [String(token), bias]));
  }
  return rest;
}

function promptFields(request) {
  return fields(typeof request === "string" ? { prompt: request } : request);
}

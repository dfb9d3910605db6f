// Endpoint resolution and checks, as docs/protocol.md "Endpoints" says; no daemon needed.
import assert from "node:assert/strict";
import { afterEach, test } from "node:test";

import { defaultEndpoint, EndpointError, parseEndpoint, resolveEndpoint } from "../src/index.js";

const saved = { ...process.env };
afterEach(() => {
  for (const name of ["KVD_ENDPOINT", "XDG_RUNTIME_DIR"]) {
    if (saved[name] === undefined) delete process.env[name];
    else process.env[name] = saved[name];
  }
});

test("the default endpoint: explicit, then $KVD_ENDPOINT, then $XDG_RUNTIME_DIR, then /tmp/kvd-$UID", () => {
  delete process.env.KVD_ENDPOINT;
  process.env.XDG_RUNTIME_DIR = "/run/user/1234/";
  assert.equal(resolveEndpoint().url, "ipc:///run/user/1234/kvd.sock");
  process.env.XDG_RUNTIME_DIR = "";
  assert.equal(resolveEndpoint().url, `ipc:///tmp/kvd-${process.getuid()}/kvd.sock`);
  assert.equal(defaultEndpoint(), `ipc:///tmp/kvd-${process.getuid()}/kvd.sock`);
  process.env.KVD_ENDPOINT = "tcp://127.0.0.1:7000";
  assert.deepEqual(resolveEndpoint(), {
    url: "tcp://127.0.0.1:7000",
    transport: "tcp",
    host: "127.0.0.1",
    port: 7000,
  });
  assert.deepEqual(resolveEndpoint("ipc:///run/kvd/kvd.sock"), {
    url: "ipc:///run/kvd/kvd.sock",
    transport: "ipc",
    path: "/run/kvd/kvd.sock",
  });
});

test("tcp hosts may be bracketed IPv6 addresses", () => {
  assert.equal(parseEndpoint("tcp://[::1]:5555").host, "::1");
});

const MALFORMED = [
  "kvd.sock",
  "ipc://relative/kvd.sock",
  "ipc://@abstract",
  `ipc:///${"x".repeat(120)}`,
  "tcp://127.0.0.1",
  "tcp://:80",
  "tcp://127.0.0.1:0",
  "tcp://127.0.0.1:65536",
  "tcp://127.0.0.1:http",
  "udp://h:9",
];

for (const url of MALFORMED) {
  test(`malformed endpoint ${url.slice(0, 40)} is refused`, () => {
    assert.throws(() => parseEndpoint(url), (e) => e instanceof EndpointError && e.code === "endpoint");
  });
}

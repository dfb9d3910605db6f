// Endpoint resolution and checks, as docs/protocol.md "Endpoints" says; no daemon needed.
import assert from "node:assert/strict";
import { chmodSync, chownSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { after, afterEach, test } from "node:test";

import { checkPrivateDir, isIpv6 } from "../src/endpoint.js";
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

test("IPv6 mode is for IPv6 addresses only: names resolve to IPv4, as the daemon binds them", () => {
  for (const url of ["tcp://[::1]:5555", "tcp://::1:5555", "tcp://[2001:db8::5]:5555"]) {
    assert.equal(isIpv6(parseEndpoint(url)), true, url);
  }
  for (const url of ["tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://*:5555", "ipc:///tmp/x.sock"]) {
    assert.equal(isIpv6(parseEndpoint(url)), false, url);
  }
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

// The /tmp folder of the default endpoint, as the daemon demands of it: a real directory, ours, closed to others.
const dirs = mkdtempSync(path.join(tmpdir(), "kvd-js-dirs-"));
after(() => rmSync(dirs, { recursive: true, force: true }));

function folder(name, mode = 0o700) {
  const dir = path.join(dirs, name);
  mkdirSync(dir);
  chmodSync(dir, mode); // mkdir's mode is cut by the umask
  return dir;
}

function assertRefused(dir, why) {
  const expected = (e) => e instanceof EndpointError && e.message.includes(why) && e.message.includes("KVD_ENDPOINT");
  assert.throws(() => checkPrivateDir(dir), expected);
}

test("a private folder, or none yet, is accepted", () => {
  checkPrivateDir(folder("private"));
  checkPrivateDir(path.join(dirs, "missing")); // the daemon creates it
});

test("a symbolic link, a file or a folder open to others is refused", () => {
  const link = path.join(dirs, "link");
  symlinkSync(folder("target"), link);
  assertRefused(link, "symbolic link");
  const file = path.join(dirs, "file");
  writeFileSync(file, "");
  assertRefused(file, "not a directory");
  const open = folder("open", 0o755);
  assertRefused(open, `chmod 700 ${open}`);
});

const notRoot = process.getuid() !== 0 && "giving a folder to another user needs root";
test("a folder of another user is refused", { skip: notRoot }, () => {
  const theirs = folder("theirs");
  chownSync(theirs, 65534, 65534);
  assertRefused(theirs, "belongs to another user (uid 65534)");
});

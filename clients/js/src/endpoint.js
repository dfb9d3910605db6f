// Where the daemon listens by default and how an endpoint string is checked, as docs/protocol.md says: an
// explicit endpoint, else $KVD_ENDPOINT, else ipc://$XDG_RUNTIME_DIR/kvd.sock, else ipc:///tmp/kvd-$UID/kvd.sock.
// The last one lies in a folder anyone could create first, so it is used only when that folder is private.
import fs from "node:fs";
import path from "node:path";

import { EndpointError } from "./errors.js";

export const ENV_VAR = "KVD_ENDPOINT";
const SOCKET_NAME = "kvd.sock";
// sun_path holds 108 bytes including the terminating NUL.
const MAX_IPC_PATH_BYTES = 107;
// How a user whose /tmp folder is unsafe still reaches a daemon.
const ELSEWHERE = `or set XDG_RUNTIME_DIR or ${ENV_VAR} to choose another endpoint`;

/** $XDG_RUNTIME_DIR, else a per-user directory under /tmp (the daemon creates it with mode 0700). */
export function defaultSocketDir() {
  const runtime = process.env.XDG_RUNTIME_DIR;
  if (runtime) return runtime;
  // Literally /tmp, not $TMPDIR: a client and the daemon must agree even when their environments differ.
  return `/tmp/kvd-${process.getuid()}`;
}

export function defaultEndpoint() {
  return `ipc://${path.join(defaultSocketDir(), SOCKET_NAME)}`;
}

/**
 * The endpoint to use, parsed: the argument, else $KVD_ENDPOINT, else the per-user default; throws
 * EndpointError when the default falls back to a /tmp folder that is not this user's private one.
 */
export function resolveEndpoint(endpoint) {
  const chosen = endpoint || process.env[ENV_VAR];
  if (chosen) return parseEndpoint(chosen);
  // $XDG_RUNTIME_DIR is made by the login manager for this user alone; /tmp is everyone's.
  if (!process.env.XDG_RUNTIME_DIR) checkPrivateDir(defaultSocketDir());
  return parseEndpoint(defaultEndpoint());
}

/**
 * Throws EndpointError unless `dir` is a real directory of this user closed to others, as the daemon demands
 * of it: anyone may create /tmp/kvd-$UID first and listen there, reading every prompt sent. A missing
 * directory passes: the daemon creates it.
 */
export function checkPrivateDir(dir) {
  let st;
  try {
    st = fs.lstatSync(dir);
  } catch (e) {
    if (e.code === "ENOENT") return;
    throw new EndpointError(`cannot check ${dir}: ${e.message}; ${ELSEWHERE}`);
  }
  if (st.isSymbolicLink()) {
    throw new EndpointError(`${dir} is a symbolic link, not a directory of yours; remove it, ${ELSEWHERE}`);
  }
  if (!st.isDirectory()) throw new EndpointError(`${dir} is not a directory; remove it, ${ELSEWHERE}`);
  if (st.uid !== process.getuid()) {
    throw new EndpointError(`${dir} belongs to another user (uid ${st.uid}); remove it, ${ELSEWHERE}`);
  }
  if (st.mode & 0o077) {
    const mode = (st.mode & 0o7777).toString(8).padStart(4, "0");
    throw new EndpointError(
      `${dir} is open to other users (mode ${mode}); run \`chmod 700 ${dir}\`, ${ELSEWHERE}`,
    );
  }
}

/** {url, transport: "ipc", path} or {url, transport: "tcp", host, port}; throws EndpointError. */
export function parseEndpoint(url) {
  if (typeof url !== "string") {
    throw new EndpointError(`an endpoint is a string such as ipc:///run/kvd/kvd.sock, got ${typeof url}`);
  }
  const sep = url.indexOf("://");
  if (sep < 0) {
    throw new EndpointError(`endpoint '${url}' has no scheme: use ipc://ABSOLUTE_PATH or tcp://HOST:PORT`);
  }
  const scheme = url.slice(0, sep);
  const rest = url.slice(sep + 3);
  if (scheme === "ipc") return parseIpc(url, rest);
  if (scheme === "tcp") return parseTcp(url, rest);
  throw new EndpointError(`endpoint '${url}': unsupported transport '${scheme}'; use ipc:// or tcp://`);
}

/**
 * True for tcp to an IPv6 address (tcp://[::1]:PORT): its socket needs ZeroMQ's IPv6 mode. Only such a host
 * holds a colon. Host names keep to IPv4, as the daemon resolves them: in IPv6 mode libzmq would resolve
 * localhost to ::1 while the daemon bound it to 127.0.0.1.
 */
export function isIpv6(endpoint) {
  return endpoint.transport === "tcp" && endpoint.host.includes(":");
}

function parseIpc(url, socketPath) {
  if (socketPath.startsWith("@")) {
    throw new EndpointError(`endpoint '${url}': abstract sockets have no file permissions; use a filesystem path`);
  }
  if (!socketPath.startsWith("/")) {
    throw new EndpointError(`endpoint '${url}': the ipc path must be absolute (client and daemon cwd differ)`);
  }
  if (Buffer.byteLength(socketPath) > MAX_IPC_PATH_BYTES) {
    throw new EndpointError(
      `endpoint '${url}': the socket path is longer than ${MAX_IPC_PATH_BYTES} bytes, the limit of a unix ` +
        "socket address; choose a shorter path",
    );
  }
  return { url, transport: "ipc", path: socketPath };
}

function parseTcp(url, rest) {
  const colon = rest.lastIndexOf(":");
  if (colon <= 0) throw new EndpointError(`endpoint '${url}': expected tcp://HOST:PORT`);
  let host = rest.slice(0, colon);
  const port = rest.slice(colon + 1);
  if (host.startsWith("[") && host.endsWith("]")) host = host.slice(1, -1); // [::1]
  if (!/^[0-9]+$/.test(port) || Number(port) < 1 || Number(port) > 65535) {
    throw new EndpointError(`endpoint '${url}': the port must be a number in [1, 65535]`);
  }
  return { url, transport: "tcp", host, port: Number(port) };
}

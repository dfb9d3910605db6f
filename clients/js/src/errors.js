// Errors of the client: local failures (endpoint, timeout, closed, undecodable reply) and the daemon's typed
// error replies. Every error has a `code`: the protocol's error code for DaemonError, a local one otherwise.

/** The protocol's error codes (docs/protocol.md, "Errors"). */
export const ERROR_CODES = Object.freeze([
  "bad_request",
  "unsupported_version",
  "too_large",
  "overloaded",
  "not_found",
  "shutting_down",
  "internal",
  "client_timeout",
]);

/** Base class of every error this package throws. */
export class KvdError extends Error {
  constructor(message, code) {
    super(message);
    this.name = new.target.name;
    this.code = code;
  }
}

/** An endpoint string is malformed; the message shows the accepted forms. */
export class EndpointError extends KvdError {
  constructor(message) {
    super(message, "endpoint");
  }
}

/**
 * The daemon said nothing for `timeoutMs`: code "no_daemon" when the ipc socket file does not even exist,
 * "timeout" otherwise (not running, not reachable, or stuck).
 */
export class KvdTimeoutError extends KvdError {}

/** The client was closed. */
export class ClosedError extends KvdError {
  constructor(message) {
    super(message, "closed");
  }
}

/** The daemon sent a reply this client cannot read (a newer or foreign protocol). */
export class ProtocolError extends KvdError {
  constructor(message) {
    super(message, "protocol");
  }
}

/**
 * An error reply from the daemon. `code` is one of ERROR_CODES (or a newer daemon's code); `field` names the
 * request field at fault when there is one.
 */
export class DaemonError extends KvdError {
  constructor(code, message, field = null, requestId = null) {
    super(field ? `${message} (field '${field}')` : message, code);
    this.field = field;
    this.requestId = requestId;
  }
}

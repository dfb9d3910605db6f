// Client library for the kvd daemon: msgpack over ZeroMQ (docs/protocol.md).
export { Client, DEFAULT_TIMEOUT_MS, Stream } from "./client.js";
export { defaultEndpoint, parseEndpoint, resolveEndpoint } from "./endpoint.js";
export {
  ClosedError,
  DaemonError,
  EndpointError,
  ERROR_CODES,
  KvdError,
  KvdTimeoutError,
  ProtocolError,
} from "./errors.js";
export { PROTOCOL_VERSION } from "./wire.js";

"""Print the daemon's event stream (kvd serve --events ENDPOINT), one line per event.

    python examples/watch_events.py ENDPOINT [TOPIC]

TOPIC is a prefix such as uid:1000/ (one user's requests); the default, empty, shows every tenant's."""

from __future__ import annotations

import sys

import msgpack
import zmq

from kvd_client.endpoint import parse_endpoint


def main() -> None:
    endpoint = sys.argv[1]
    topic = sys.argv[2] if len(sys.argv) > 2 else ""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.ipv6 = parse_endpoint(endpoint).is_ipv6  # tcp://[::1]:PORT
    sock.connect(endpoint)
    try:
        while True:
            _, body = sock.recv_multipart()
            event = msgpack.unpackb(body)
            extra = {k: v for k, v in event.items() if k not in ("event", "tenant", "client", "id", "time")}
            print(
                f"{event['time']:.3f} {event['tenant']:>10} {event['client']} {event['id']!s:>6} "
                f"{event['event']:<9} {extra or ''}",
                flush=True,
            )
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(linger=0)


if __name__ == "__main__":
    main()

"""Client library for the kvd daemon: msgpack over ZeroMQ, with no torch dependency."""

"""The kvd daemon: protocol, sockets and the serving loop."""

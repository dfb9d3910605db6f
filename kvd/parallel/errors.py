"""The error of a group that cannot form."""


class DistributedStartupError(ValueError):
    """The ranks cannot form a group: a port taken, rank 0 unreachable, a mismatch between ranks, a secret not
    proven; one line (a ValueError: `kvd serve` prints it and exits 2)."""

"""The error of a tensor-parallel group that can no longer run a step."""


class TensorParallelError(RuntimeError):
    """A rank died, left or did not answer within the timeout: the group cannot run another step."""

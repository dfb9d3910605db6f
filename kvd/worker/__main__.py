"""`python -m kvd.worker SPEC`: a worker rank that rank 0 started on this host (kvd.parallel.launch).

SPEC is JSON: the EngineArgs, the rank's index on this host, its cores, and the descriptor of the pipe holding
the group's secret (the secret itself is never on the command line, which every user can read)."""

from __future__ import annotations

import json
import logging
import signal
import sys

from kvd.engine.engine_args import EngineArgs
from kvd.parallel.errors import DistributedStartupError
from kvd.parallel.secret import read_from_parent
from kvd.worker.run import run_worker


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    # The daemon stops its workers itself (STOP, after its drain): a SIGTERM or Ctrl-C that reaches the whole
    # process group (systemd's control-group kill, a terminal) must not end them mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = EngineArgs(**spec["args"])
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank {args.rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        secret = read_from_parent(spec["secret_fd"])
    except (DistributedStartupError, OSError) as e:
        logging.getLogger("kvd.worker").error("rank %d: %s", args.rank, e)
        return 2
    return run_worker(args, spec["local_index"], spec["cpus"], secret)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

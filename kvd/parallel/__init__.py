"""Forming a tensor-parallel group: where the ranks meet (address), the secret they prove (secret, handshake),
the rendezvous store rank 0 hosts (store), rank placement (cpu_binding), the startup exchange (group) and rank
0's side of it (launch). Below the engine, which holds the group; above kvd.distributed's primitives.

Kept free of torch at import (only its modules import it): kvd.engine.engine_args checks addresses here."""

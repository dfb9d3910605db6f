"""A tensor-parallel worker rank (ranks 1..N-1): it holds a shard, its KV pool and a ModelRunner, and runs rank
0's steps. Started by rank 0 (`python -m kvd.worker SPEC`) or, on another host, by `kvd serve --rank R
--world-size N --distributed-init tcp://HOST:PORT --distributed-secret-file FILE` (rank 0's model and
settings). Above the engine and the model, which it runs; nothing below imports it (docs/architecture.md,
"Tensor parallel")."""

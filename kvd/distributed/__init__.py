"""Tensor parallelism on torch.distributed: rank 0 is the engine, the other ranks run its steps on their shards
(docs/architecture.md, "Tensor parallel")."""

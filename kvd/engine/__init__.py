"""The engine: sequences, the paged-KV block manager, the scheduler, the model runner and the request loop."""

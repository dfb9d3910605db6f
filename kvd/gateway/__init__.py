"""The OpenAI-compatible HTTP gateway: a kvd client over ZeroMQ that serves /v1 endpoints and /metrics."""

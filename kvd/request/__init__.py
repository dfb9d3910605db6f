"""The request surface every front end shares (the daemon's wire layer, the gateway, `kvd.LLM`): sampling
parameters, structured-output schemas and tool calling. Torch-free, so the gateway can import it."""

"""One module per model family, each a CausalLM subclass named after its Hugging Face architecture that says only
what differs from the shared decoder (kvd.model.decoder); kvd.model.registry maps architectures to them."""

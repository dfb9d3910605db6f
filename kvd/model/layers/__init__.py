"""Model building blocks: attention backends over the paged KV pool, RoPE, RMSNorm, fused linears."""

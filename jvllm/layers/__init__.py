"""Model building blocks: attention dispatch, rotary embeddings, norms, linear layers, sampler."""

"""vLLM's entry-point module paths, so that vLLM launch lines run unchanged."""

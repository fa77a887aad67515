"""OpenAI-compatible HTTP server (installed as `jvllm.server`)."""

"""`python -m jvllm.entrypoints.openai.api_server`: vLLM's OpenAI server module path."""

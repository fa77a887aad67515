"""The engine core in a process of its own (vLLM V1's EngineCore) and the front end's
client of it: `core.py` serves, `client.py` asks, `messages.py` is the wire,
`launcher.py` starts and stops the processes."""

"""Pooling models (vLLM's `runner="pooling"`): embeddings, classification, scores.

`config.py` resolves the runner and the pooler, `params.py` and `outputs.py` are the
request and output types (vLLM's names), `offline.py` the `LLM` methods, `factory.py`
builds the engine. The engine side is `jvllm/engine/pooling_engine.py`; the device side
`jvllm/runner/pooling_runner.py`; the HTTP routes `jvllm/server/serving_pooling.py`.
"""

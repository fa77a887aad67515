"""LoRA adapters: requests naming them (`request.py`), the engine's knobs (`config.py`),
reading PEFT adapter directories (`peft_adapter.py`), the host cache of read adapters and
the device slots they occupy (`adapter_cache.py`), and the forward's low-rank products
(`punica.py`, `interceptor.py`). Host-side modules import no jax.
"""

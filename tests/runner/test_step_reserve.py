"""The step reserve the KV-cache sizing keeps (jvllm.runner.aot.measure_step_reserve),
measured on this machine's CPU device from a real loaded checkpoint, as the engine
measures it on a GPU."""

from __future__ import annotations

import jax

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import load_model
from jvllm.runner import aot


def test_the_reserve_is_the_largest_buckets_temporaries_and_inputs(checkpoints):
    """The largest bucket's programs only; their temporaries and fresh outputs, plus the
    step's inputs. That a larger cache leaves the figure as it is, tests/gpu_compile
    checks at an H200's real cache size."""
    loaded = load_model(checkpoints["llama"], "float32", "reference")
    cache = CacheConfig(block_size=16)
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    device = jax.local_devices()[0]
    reserve, programs = aot.measure_step_reserve(loaded, device, cache, scheduler)
    names = {p.name for p in programs}
    assert {"forward", "copy"} <= names, names
    forwards = [p.label for p in programs if p.name == "forward"]
    assert len(forwards) == 1 and "num_tokens=32," in forwards[0], forwards
    transient = aot.step_transient_bytes(programs)
    assert 0 < transient <= reserve < transient + (1 << 20)  # + the step's small inputs

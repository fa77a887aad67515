"""An fp8 KV cache (kv_cache_dtype="fp8"): twice the blocks of bfloat16 in the same
budget, next-token agreement with a bfloat16 cache on the demo model's own text, and
swap preemption moving its bytes exactly."""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import CacheConfig
from jvllm.demo.corpus import PROMPTS
from tests.models.test_quantization import prompt_row

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def test_fp8_holds_twice_the_blocks_of_bfloat16(checkpoints) -> None:
    budget = 200 * 1024
    blocks = {
        kv: LLM(
            str(checkpoints["llama"]), dtype="bfloat16", kv_cache_dtype=kv,
            cpu_kv_cache_bytes=budget, **ENGINE
        ).engine.runner.num_blocks
        for kv in ("auto", "fp8")
    }  # fmt: skip
    assert blocks["fp8"] - 1 >= 1.9 * (blocks["auto"] - 1), blocks  # less the null block


def test_next_token_agreement_with_a_bfloat16_cache() -> None:
    """Teacher-forced: the demo model's own greedy text, scored under each cache; the
    argmax at each position agrees on at least 95% of them (97% measured)."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(16)]
    argmax, sequences = {}, None
    for kv in ("auto", "fp8"):
        # A budget of 128 holds every sequence: few token buckets to compile.
        llm = LLM(dtype="bfloat16", kv_cache_dtype=kv, max_num_batched_tokens=128, max_num_seqs=16)
        assert str(llm.engine.runner.kv_dtype) == ("bfloat16" if kv == "auto" else "float8_e4m3fn")
        if sequences is None:
            outs = llm.chat(chats, params, use_tqdm=False)
            sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        runner = llm.engine.runner
        argmax[kv] = [
            runner.forward_logits([prompt_row(s)], every_token=True)[0].argmax(-1)
            for s in sequences
        ]
    agree = np.concatenate([a == b for a, b in zip(argmax["auto"], argmax["fp8"], strict=True)])
    assert agree.mean() >= 0.95, agree.mean()


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_swap_moves_fp8_blocks_exactly(checkpoints, kv) -> None:
    rng = np.random.default_rng(1)
    batch = [
        {"prompt_token_ids": [int(t) for t in rng.integers(6, 500, n)]} for n in (90, 120, 60, 150)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for mode in ("recompute", "swap"):
        llm = LLM(
            str(checkpoints["llama"]), kv_cache_dtype=kv, num_gpu_blocks_override=24,
            preemption_mode=mode, **ENGINE
        )  # fmt: skip
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        metrics = llm.get_metrics()
        assert metrics["num_preemptions"] > 0
        if mode == "swap":
            assert metrics["num_swapped_in_blocks"] > 0
    assert outs["swap"] == outs["recompute"]


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8"):
        CacheConfig(kv_cache_dtype="int4")

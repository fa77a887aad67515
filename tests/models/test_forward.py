"""The jitted forward over the paged cache against Transformers' full forward.

Tolerance: float32 on CPU, |jvllm - HF| <= 1e-4 * max(1, max|logits|). The two
sides sum in different orders (blocked attention, fused einsums), so exact
equality is not expected; measured differences are ~3e-6 on logits of size ~3.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import load_model
from jvllm.runner.model_runner import ModelRunner

BLOCK = 16


@dataclasses.dataclass
class Row:
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    prev_step_row: int | None = None
    num_spec_tokens: int = 0
    table_row: int = -1  # none: the block_table list is packed


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:  # [len(ids), V]
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def assert_close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> None:
    tol = rel * max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ours - ref).max())
    assert err <= tol, f"max |diff| {err:.3g} > tolerance {tol:.3g}"


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, size=n)]


def make_runner(path, dtype: str = "float32", num_blocks: int = 128) -> ModelRunner:
    return ModelRunner(
        load_model(path, dtype),
        num_blocks=num_blocks,
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512
        ),
    )


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100])
def test_full_prompt_logits_match_hf(arch, checkpoints, hf_models, length):
    runner = make_runner(checkpoints[arch])
    ids = random_ids(length, seed=length)
    blocks = list(range(1, 1 + -(-length // BLOCK)))
    (ours,) = runner.forward_logits([Row(ids, 0, blocks)], every_token=True)
    assert_close(ours, hf_logits(hf_models[arch], ids))


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_then_decode_match_full_forward(arch, checkpoints, hf_models, chunk):
    runner = make_runner(checkpoints[arch])
    prompt_len, decode_steps = 40, 20
    ids = random_ids(prompt_len + decode_steps, seed=chunk)
    ref = hf_logits(hf_models[arch], ids)
    # Shuffled, non-contiguous physical blocks.
    blocks = [int(b) for b in np.random.default_rng(chunk).permutation(np.arange(1, 100))[:4]]
    got = []
    for start in range(0, prompt_len, chunk):
        piece = ids[start : min(start + chunk, prompt_len)]
        got += list(runner.forward_logits([Row(piece, start, blocks)], every_token=True)[0])
    for pos in range(prompt_len, prompt_len + decode_steps):
        got.append(runner.forward_logits([Row([ids[pos]], pos, blocks)])[0])
    assert_close(np.stack(got), ref)


def test_mixed_batch_matches_each_sequence_alone(arch, checkpoints, hf_models):
    """One step with 6 sequences, 3 decoding and 3 in prefill, on shuffled blocks."""
    runner = make_runner(checkpoints[arch])
    rng = np.random.default_rng(7)
    free = [int(b) for b in rng.permutation(np.arange(1, 128))]
    lengths = [5, 33, 70, 16, 1, 47]  # total tokens in the cache after the mixed step
    done_before = [4, 32, 69, 0, 0, 20]  # 3 decodes (one new token each), 3 prefills
    seqs = []
    for i, (n, before) in enumerate(zip(lengths, done_before, strict=True)):
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        seqs.append((random_ids(n, seed=100 + i), before, table))
    # Earlier steps: fill each sequence's cached prefix (two sequences per step).
    warm = [Row(ids[:before], 0, table) for ids, before, table in seqs if before]
    for k in range(0, len(warm), 2):
        runner.forward_logits(warm[k : k + 2])
    rows = [Row(ids[before:], before, table) for ids, before, table in seqs]
    mixed = runner.forward_logits(rows, every_token=True)
    for (ids, before, _), ours in zip(seqs, mixed, strict=True):
        assert_close(ours, hf_logits(hf_models[arch], ids)[before:])


def test_bfloat16_close_to_float32(checkpoints):
    path = checkpoints["llama"]
    ids = random_ids(50, seed=3)
    rows = [Row(ids, 0, [1, 2, 3, 4])]
    f32 = make_runner(path, "float32").forward_logits(rows, every_token=True)[0]
    bf16 = make_runner(path, "bfloat16").forward_logits(rows, every_token=True)[0]
    assert bf16.dtype == np.float32 and np.isfinite(bf16).all()
    # bfloat16 keeps 8 mantissa bits: ~0.4% per rounding, compounded over 2 layers.
    assert_close(bf16, f32, rel=0.05)
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() > 0.9


def test_padding_writes_only_the_null_block(checkpoints):
    runner = make_runner(checkpoints["qwen3"], num_blocks=8)
    ids = random_ids(5, seed=1)  # 5 tokens padded to a 16-token bucket
    runner.forward_logits([Row(ids, 0, [3])])
    k_cache = np.asarray(runner.caches[0][0])
    written = np.flatnonzero(np.abs(k_cache).reshape(8, -1).sum(-1))
    assert set(written) <= {0, 3}
    assert np.abs(k_cache[3, :5]).sum() > 0 and np.abs(k_cache[3, 5:]).sum() == 0

"""The KV-cache sizing rule (jvllm.runner.memory)."""

from __future__ import annotations

from jvllm.models.spec import spec_from_hf_config
from jvllm.runner import memory

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)


def test_an_8b_block_is_two_mib_and_splits_over_tp():
    spec = spec_from_hf_config(LLAMA3_8B)
    assert memory.kv_block_bytes(spec, 16, 2, 1) == 2 << 20  # 2 x 32 layers x 16 x 8 x 128 x 2
    assert memory.kv_block_bytes(spec, 16, 2, 4) == 512 << 10


def test_blocks_fill_the_budget_up_to_what_sequences_can_use():
    block = 1 << 20
    budget = memory.gpu_budget(100 * block, 20 * block, 0.5, 10 * block)
    assert budget == 20 * block
    size = memory.kv_cache_size(budget, block, 16, max_num_seqs=4, max_model_len=1024)
    assert size == memory.KVCacheSize(21, 16, block)  # 20 + the null block
    assert size.num_tokens == 320
    capped = memory.kv_cache_size(budget, block, 16, max_num_seqs=1, max_model_len=64)
    assert capped.num_blocks == 4 + 1
    assert memory.kv_cache_size(-budget, block, 16, 4, 1024).num_blocks == 1


def test_reserve_is_four_float32_logits_arrays():
    assert memory.activation_reserve(2048, 128256) == 4 * 2048 * 128256 * 4

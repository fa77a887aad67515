"""KV bytes held by one long request of Gemma-2-9B and gpt-oss-20b, with the hybrid KV
layout (sliding-window blocks freed, full and sliding layers sharing cache arrays) and
with the one-table layout (every layer keeps every position).

No model runs: the engine's own KV cache managers (`KVCacheManager`,
`HybridKVCacheManager`) allocate for one request as the scheduler would (a prompt in
chunks of `--chunk` tokens, then one token a step up to `--context` tokens), and the
block bytes come from the models' own config.json reading (`gemma_spec`, `gpt_oss_spec`)
and `runner.memory.kv_block_bytes`, halved in the hybrid layout as the engine sizes it.
Reports the blocks and bytes held at the end and at the peak (bfloat16 KV, TP=1).

    python -m bench.kv_sliding_window --output bench/results/kv_sliding_window.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from jvllm.config import CacheConfig
from jvllm.engine.kv.hybrid_kv_cache_manager import HybridKVCacheManager
from jvllm.engine.kv.kv_cache_manager import KVCacheManager
from jvllm.engine.request import Request
from jvllm.models.gemma import gemma_spec
from jvllm.models.gpt_oss import gpt_oss_spec
from jvllm.models.kv_groups import hybrid_sliding_window
from jvllm.runner.memory import kv_block_bytes
from jvllm.sampling_params import SamplingParams
from jvllm.testing.deviceless_variants import GEMMA2_9B, GPT_OSS_20B  # released configs

GIB = 1024**3


def held_blocks(kv: KVCacheManager, context: int, chunk: int) -> tuple[int, int]:
    """Blocks held (at the end, at the peak) by one request run to `context` tokens."""
    prompt_len = context - 256
    request = Request("r", [1] * prompt_len, SamplingParams(max_tokens=256))
    peak = 0
    while request.num_computed_tokens < context:
        if request.num_computed_tokens >= prompt_len:
            request.output_token_ids.append(1)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, num_new)
        request.num_computed_tokens += num_new
        peak = max(peak, kv.num_allocated_blocks)
    return kv.num_allocated_blocks, peak


def measure(name: str, cfg: dict[str, Any], context: int, chunk: int, bs: int) -> dict:
    spec = gemma_spec(cfg) if "Gemma" in cfg["architectures"][0] else gpt_oss_spec(cfg)
    window = hybrid_sliding_window(spec, False, False, 1)
    assert window is not None, name
    itemsize = 2  # bfloat16
    one_table_block = kv_block_bytes(spec, bs, itemsize, 1)
    num_blocks = 2 * -(-context // bs) + 8
    out: dict[str, Any] = dict(model=name, context=context, window=window, block_size=bs)
    one_table = KVCacheManager(num_blocks, bs, False, max_model_len=context)
    hybrid = HybridKVCacheManager(num_blocks, bs, window, context)
    for layout, kv, block_bytes in (
        ("one_table", one_table, one_table_block),
        ("hybrid", hybrid, one_table_block // 2),
    ):
        end, peak = held_blocks(kv, context, chunk)
        out[layout] = dict(
            block_bytes=block_bytes,
            blocks_held=end,
            peak_blocks=peak,
            gib_held=round(end * block_bytes / GIB, 3),
            peak_gib=round(peak * block_bytes / GIB, 3),
        )
    return out


def main() -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    bs = CacheConfig().block_size
    results = [
        measure(name, cfg, args.context, args.chunk, bs)
        for name, cfg in (("gemma-2-9b", GEMMA2_9B), ("gpt-oss-20b", GPT_OSS_20B))
    ]
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()

"""The deviceless predictions for an H200 beside what a lent GPU shows.

Reads bench/results/deviceless_h200.json (tests/gpu_compile writes it when
JVLLM_DEVICELESS_PREDICTIONS names that path) and prints, for each attention launch of
the 8B step, the registers, spills and shared memory ptxas predicted next to what the
CUDA driver reports for the same kernel built here by Triton; then the KV-cache blocks
the sizing rule predicted next to the `num_kv_blocks` of a bench/throughput.py result.
Best effort: a figure that cannot be measured prints as "-" with the reason.

    python bench/gpu_predictions.py [--throughput bench/results/throughput_8b.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common

PREDICTIONS = common.RESULTS_DIR / "deviceless_h200.json"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def measure_attention(num_tokens: int, num_seqs: int, width: int) -> dict[str, Any]:
    """Driver-reported resources of the attention kernel at one 8B bucket (not run)."""
    import torch

    from jvllm.kernels import triton_attention as ta

    cfg = ta.launch_config(num_tokens, num_seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
    new = lambda *shape, dtype=torch.bfloat16: torch.zeros(shape, dtype=dtype, device="cuda")
    q = new(num_tokens, NUM_HEADS, HEAD_DIM)
    cache = new(64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    meta = [new(num_seqs, width, dtype=torch.int32), new(num_seqs, dtype=torch.int32)]
    meta.append(new(num_seqs + 1, dtype=torch.int32))
    part_out, part_lse = ta.partial_shapes(cfg, tuple(q.shape))
    split = cfg.num_splits > 1
    out = new(*part_out, dtype=torch.float32) if split else new(*q.shape)
    lse = new(*part_lse, dtype=torch.float32) if split else new(1, dtype=torch.float32)
    params = ta.kernel_params(
        cfg, tuple(q.shape), tuple(cache.shape), (num_seqs, width), 0.1, None, "bfloat16"
    )
    kernel = ta.paged_attention_kernel.warmup(
        q,
        cache,
        cache,
        *meta,
        lse,  # the sinks pointer, unread without sinks
        out,
        lse,
        grid=ta.attention_grid(cfg, num_tokens, num_seqs, NUM_KV_HEADS),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **params,
    )
    kernel._init_handles()  # loads the cubin: the driver fills in registers and spills
    return dict(registers=kernel.n_regs, spills=kernel.n_spills, shared=kernel.metadata.shared)


def kernel_lines(predicted: dict[str, Any]) -> list[str]:
    lines = ["attention kernel, 8B bf16: predicted (ptxas, deviceless) | measured (driver)"]
    for k in predicted["kernels"]:
        if k["model"] != "8b bf16" or k["kernel_name"] != "paged_attention_kernel":
            continue
        t, s, w = map(int, re.findall(r"=(\d+)", k["label"]))
        try:
            got = measure_attention(t, s, w)
            measured = f"{got['registers']} regs, {got['spills']} spilled, {got['shared']} B smem"
        except Exception as e:  # no GPU, or another Triton's API
            measured = f"- ({type(e).__name__}: {str(e)[:80]})"
        lines.append(
            f"  T={t:5} S={s:4}: {k['registers']} regs, {k['spill_bytes']} B spilled, "
            f"{k['shared_bytes']} B smem | {measured}"
        )
    return lines


def _find(tree: Any, key: str) -> Any:
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    for item in tree if isinstance(tree, list) else ():
        if (found := _find(item, key)) is not None:
            return found
    return None


def kv_lines(predicted: dict[str, Any], throughput: Path) -> list[str]:
    kv = predicted["kv_cache_throughput_8b"]
    measured = "-"
    if throughput.is_file():
        measured = str(_find(json.loads(throughput.read_text()), "num_kv_blocks") or "-")
    return [
        f"KV cache, 8B at gpu_memory_utilization={predicted['utilization']} {kv['sizes']}:",
        f"  predicted {kv['num_blocks']} blocks ({kv['kv_tokens']} tokens) | measured "
        f"{measured} blocks ({throughput.name})",
        f"  8B at max_model_len 8192: predicted {predicted['kv_cache_8b']['kv_tokens']} tokens",
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predictions", type=Path, default=PREDICTIONS)
    parser.add_argument(
        "--throughput", type=Path, default=common.RESULTS_DIR / "throughput_8b.json"
    )
    args = parser.parse_args(argv)
    predicted = json.loads(args.predictions.read_text())
    print(predicted["target"])
    print("\n".join(kernel_lines(predicted) + kv_lines(predicted, args.throughput)))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Decode attention on a GPU: the Triton paged-attention kernel against memory bandwidth.

Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128, bfloat16,
block size 16): one decode token per sequence at batch 64 and 256 and contexts 512 to
8192, every sequence at the full context, block tables shuffled. For each shape: the
kernel's median time (CUDA-graph replays of many launches, timed with CUDA events by
`triton.testing.do_bench_cudagraph`), the bytes it must move (K and V once, q in, out
out, block tables), the bandwidth that gives, and its ratio to a device-to-device copy
measured in this process. Launches rotate over enough input sets to overflow the L2
cache. Also the jax-triton path that the engine runs (a chain of calls inside one jit,
host-timed), and with --sweep BATCHES a few launch configurations at context 4096.
Goal (issue 4): batch 256, context 4096 at >= 80% of the copy bandwidth.

    python bench/kernel.py [--batches 64,256] [--contexts 512,...,8192] [--sweep 256]

Needs an NVIDIA GPU; writes bench/results/kernel.json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common

# Torch and JAX share the GPU in one process: neither may grab most of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
ITEMSIZE = 2  # bfloat16
ROTATE_BYTES = 512 << 20  # K/V read per timed step: several times the 50 MB L2
COPY_BYTES = 4 << 30
DEVICE = "cuda"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]
    p.add_argument("--batches", type=ints, default=[64, 256])
    p.add_argument("--contexts", type=ints, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--sweep", type=ints, default=[], help="batches to try launch configs at")
    p.add_argument("--skip-jax", action="store_true", help="time the Triton launch only")
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "kernel.json")
    return p.parse_args(argv)


def require_gpu() -> None:
    import torch

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("bench/kernel.py: unset TRITON_INTERPRET; it times compiled kernels")
    if not torch.cuda.is_available():
        sys.exit(
            "bench/kernel.py times the Triton attention kernel on an NVIDIA GPU, and torch "
            "sees no CUDA device here. On a lent GPU, run bench/gpu_check.sh."
        )


def bytes_moved(batch: int, context: int) -> int:
    """The least traffic a decode step can have: every K/V entry read once, q read,
    the output written, and the block tables read."""
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * ITEMSIZE
    q_and_out = 2 * batch * NUM_HEADS * HEAD_DIM * ITEMSIZE
    tables = batch * math.ceil(context / BLOCK_SIZE) * 4
    return kv + q_and_out + tables


def rotation(batch: int, context: int) -> int:
    """Input sets to cycle through so that no launch finds its K/V in L2."""
    return max(1, math.ceil(ROTATE_BYTES / bytes_moved(batch, context)))


def copy_bandwidth() -> float:
    """Bytes/s (read + write) of one large device-to-device copy."""
    import torch
    import triton.testing

    src = torch.randn(COPY_BYTES // 2, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * COPY_BYTES / (ms * 1e-3)


def time_triton(batch: int, context: int, **overrides: Any) -> dict[str, Any]:
    """Median seconds per launch of the kernels through Triton's launcher."""
    import torch
    import triton.testing

    from jvllm.kernels import triton_attention as ta

    sets, per_seq = rotation(batch, context), math.ceil(context / BLOCK_SIZE)
    num_blocks = 1 + sets * batch * per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(cache_shape, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn(cache_shape, dtype=torch.bfloat16, device=DEVICE)
    tables = (torch.randperm(num_blocks - 1, device=DEVICE) + 1).int().view(sets, batch, per_seq)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    cfg = ta.launch_config(batch, batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, ITEMSIZE)
    cfg = cfg._replace(**overrides)
    out = torch.empty_like(q)
    part_out, part_lse = (torch.empty(s, device=DEVICE) for s in ta.partial_shapes(cfg, q.shape))

    def step() -> None:
        for r in range(sets):
            args = (q, k, v, tables[r], seq_lens, starts, out, part_out, part_lse, cfg)
            ta.launch(*args, HEAD_DIM**-0.5, None)

    runs = triton.testing.do_bench_cudagraph(step, rep=100, return_mode="all")
    seconds = statistics.median(runs) * 1e-3 / sets
    spread = (max(runs) - min(runs)) / statistics.median(runs)
    return dict(seconds=seconds, spread=spread, config=cfg._asdict(), rotation=sets)


def time_jax(batch: int, context: int, repeats: int = 10) -> float:
    """Median seconds per call of the jax-triton path, chained inside one jit so that
    host dispatch is paid once per chain (each call's output is the next call's q)."""
    import jax
    import jax.numpy as jnp

    from jvllm.kernels import jax_triton_attention

    sets, per_seq = rotation(batch, context), math.ceil(context / BLOCK_SIZE)
    num_blocks = 1 + sets * batch * per_seq
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = jax.random.normal(keys[0], shape, jnp.bfloat16)
    v = jax.random.normal(keys[1], shape, jnp.bfloat16)
    perm = jax.random.permutation(keys[2], num_blocks - 1) + 1
    tables = perm.astype(jnp.int32).reshape(sets, batch, per_seq)
    q = jax.random.normal(keys[3], (batch, NUM_HEADS, HEAD_DIM), jnp.bfloat16)
    seq_lens = jnp.full((batch,), context, jnp.int32)
    starts = jnp.arange(batch + 1, dtype=jnp.int32)
    calls = max(repeats, sets)

    @jax.jit
    def chain(q: jax.Array, k: jax.Array, v: jax.Array, tables: jax.Array) -> jax.Array:
        for i in range(calls):
            q = jax_triton_attention.paged_attention(
                q, k, v, tables[i % sets], seq_lens, starts, HEAD_DIM**-0.5
            )
        return q

    chain(q, k, v, tables).block_until_ready()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        chain(q, k, v, tables).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls


def measure(batch: int, context: int, copy_bw: float, skip_jax: bool) -> dict[str, Any]:
    import torch

    nbytes = bytes_moved(batch, context)
    row = dict(batch=batch, context=context, bytes=nbytes, **time_triton(batch, context))
    torch.cuda.empty_cache()  # hand torch's cached blocks back before JAX allocates
    row["bandwidth"] = nbytes / row["seconds"]
    row["ratio_to_copy"] = row["bandwidth"] / copy_bw
    if not skip_jax:
        try:
            row["jax_seconds"] = time_jax(batch, context)
            row["jax_ratio_to_copy"] = nbytes / row["jax_seconds"] / copy_bw
        except Exception as e:  # the Triton numbers stand on their own
            row["jax_error"] = f"{type(e).__name__}: {e}"[:500]
    common.log(
        f"batch {batch} context {context}: {row['seconds'] * 1e6:.1f} us, "
        f"{row['bandwidth'] / 1e9:.0f} GB/s, {row['ratio_to_copy']:.0%} of copy"
    )
    return row


SWEEP = [dict(tile_n=t, num_splits=s) for t in (32, 64, 128) for s in (1, 2, 4)] + [
    dict(tile_n=64, num_warps=8),
    dict(tile_n=64, num_stages=2),
    dict(tile_n=64, num_stages=4),
]


def sweep(batch: int, context: int, copy_bw: float) -> list[dict[str, Any]]:
    rows = []
    for overrides in SWEEP:
        try:
            timing = time_triton(batch, context, **overrides)
        except Exception as e:  # e.g. a tile that needs more shared memory than an SM has
            rows.append(dict(batch=batch, context=context, overrides=overrides, error=str(e)[:300]))
            continue
        ratio = bytes_moved(batch, context) / timing["seconds"] / copy_bw
        rows.append(dict(batch=batch, context=context, overrides=overrides, **timing, ratio=ratio))
    return rows


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    require_gpu()
    import torch

    result = common.envelope(__file__, argv)
    result["device"] = torch.cuda.get_device_name()
    result["shape"] = dict(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE
    )
    copy_bw = copy_bandwidth()
    result["copy_bandwidth"] = copy_bw
    common.log(f"{result['device']}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    result["rows"] = [
        measure(b, c, copy_bw, args.skip_jax) for b in args.batches for c in args.contexts
    ]
    if args.sweep:
        result["sweep"] = [r for b in args.sweep for r in sweep(b, 4096, copy_bw)]
    common.write_result(args.output, result)
    print(report(result))


def report(result: dict[str, Any]) -> str:
    headers = ["batch", "context", "us", "MB", "GB/s", "of copy", "splits", "jax us", "jax of copy"]
    rows = [
        [
            r["batch"],
            r["context"],
            r["seconds"] * 1e6,
            r["bytes"] / 1e6,
            r["bandwidth"] / 1e9,
            f"{r['ratio_to_copy']:.0%}",
            r["config"]["num_splits"],
            r["jax_seconds"] * 1e6 if "jax_seconds" in r else "-",
            f"{r['jax_ratio_to_copy']:.0%}" if "jax_seconds" in r else "-",
        ]
        for r in result["rows"]
    ]
    lines = [f"{result['device']}: copy {result['copy_bandwidth'] / 1e9:.0f} GB/s"]
    best = [s for s in result.get("sweep", []) if "ratio" in s]
    for batch in sorted({s["batch"] for s in best}):
        top = max((s for s in best if s["batch"] == batch), key=lambda s: s["ratio"])
        lines.append(f"sweep best at batch {batch}: {top['overrides']} {top['ratio']:.0%} of copy")
    return "\n".join([common.format_table(headers, rows), *lines])


if __name__ == "__main__":
    main(sys.argv[1:])

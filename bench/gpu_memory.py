"""XLA's allocator on a lent GPU beside the KV-cache budget jvllm plans for it.

Run in a process of its own, before anything else in it uses the GPU: sets XLA's
allocator as `LLM` and `jvllm serve` do (from --gpu-memory-utilization, unless the
XLA_PYTHON_CLIENT_* variables are set), starts JAX's backend, and prints device 0's
`memory_stats()` and, beside them, the sizing rule's plan for the 8B shapes of
tests/gpu_compile (weights from the abstract parameters, the step reserve the deviceless
compile measured) and the deviceless prediction of the same. Without a GPU it prints
what the backend reports and no plan.

    python bench/gpu_memory.py [--gpu-memory-utilization 0.9] [--output F.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from jvllm.runner import memory, xla_allocator

PREDICTIONS = common.RESULTS_DIR / "deviceless_h200.json"


def plan(stats: dict[str, int], utilization: float, device: Any) -> dict[str, Any]:
    """The sizing rule for the deviceless 8B shapes on this device."""
    import jax
    import jax.numpy as jnp

    from jvllm.runner.aot import abstract_model
    from jvllm.testing.deviceless import EIGHT_B
    from jvllm.testing.deviceless_cli import eight_b_spec

    loaded = abstract_model(eight_b_spec(), jnp.bfloat16, "reference", None, device)
    weights = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(loaded.params))
    predicted = json.loads(PREDICTIONS.read_text())["kv_cache_8b"] if PREDICTIONS.exists() else {}
    reserve = predicted.get("reserve_bytes") or memory.activation_reserve(
        EIGHT_B.max_num_batched_tokens, loaded.spec.vocab_size
    )
    total, cap = xla_allocator.device_limits(stats)
    budget = memory.gpu_budget(total, weights, utilization, reserve, cap)
    block = memory.kv_block_bytes(loaded.spec, EIGHT_B.block_size, 2, 1)
    size = memory.kv_cache_size(
        budget.kv_bytes, block, EIGHT_B.block_size, EIGHT_B.max_num_seqs, EIGHT_B.max_model_len
    )
    return dict(
        budget._asdict(),
        kv_bytes=budget.kv_bytes,
        kv_tokens=size.num_tokens,
        weights=weights,
        predicted=predicted,
    )


def table(stats: dict[str, int], planned: dict[str, Any]) -> str:
    gib = lambda n: "-" if n is None else f"{n / memory.GIB:.2f} GiB"
    p = planned.get("predicted", {})
    rows = [
        ("device total", gib(planned.get("total")), gib(p.get("total_bytes"))),
        ("limit (x utilization)", gib(planned.get("limit")), gib(p.get("limit_bytes"))),
        ("memory_stats bytes_limit", gib(stats.get("bytes_limit")), "-"),
        ("memory_stats pool_bytes", gib(stats.get("pool_bytes")), "-"),
        ("memory_stats bytes_in_use", gib(stats.get("bytes_in_use")), "-"),
        ("weights (8B, bf16)", gib(planned.get("weights")), gib(p.get("weight_bytes"))),
        ("step reserve", gib(planned.get("reserve")), gib(p.get("reserve_bytes"))),
        ("KV-cache budget", gib(planned.get("kv_bytes")), gib(p.get("budget_bytes"))),
        ("KV tokens", str(planned.get("kv_tokens", "-")), str(p.get("kv_tokens", "-"))),
    ]
    return common.format_table(["figure", "this GPU", "deviceless H200"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    setting = xla_allocator.configure_allocator(args.gpu_memory_utilization)
    import jax

    device = jax.local_devices()[0]
    stats = dict(device.memory_stats() or {})
    env = {k: os.environ.get(k) for k in xla_allocator.USER_SETTINGS}
    common.log(f"{device.device_kind}: allocator {setting.how} ({setting.message}); env {env}")
    common.log(f"memory_stats(): {stats}")
    planned = plan(stats, args.gpu_memory_utilization, device) if "bytes_limit" in stats else {}
    print(table(stats, planned), flush=True)
    if args.output:
        result = common.envelope("bench/gpu_memory.py", sys.argv[1:] if argv is None else argv)
        result |= dict(allocator=setting.how, env=env, memory_stats=stats, plan=planned)
        common.write_result(args.output, result)


if __name__ == "__main__":
    main()

"""The deviceless H200 compile of tests/gpu_compile, as one command and one report.

Owns which models, sizes and topologies are checked (an 8B-shaped Llama in bf16 on one
H200, its KV cache sized at gpu_memory_utilization 0.9 and 0.5 with the measured step
reserve, and one forward compiled without XLA being told the budget, whose scheduler
warning shows what the others avoid; the tiny checkpoints of every architecture in bf16
and f32; TP=2/4/8 in one process and TP=2 over two; the bad launches; the attention
kernel with Gemma 2's soft cap and gpt-oss's sinks at those models' shapes), the JSON
report, its printed summary and the predictions that bench/gpu_check.sh prints beside a
real GPU's figures. The checks themselves are jvllm.testing.deviceless. Run it from the
repository root (the 8B shapes are bench.common's preset) in its own process, with
JAX_PLATFORMS=cpu, the CUDA PJRT plugin and jax-triton importable and
JVLLM_TRITON_COMPUTE_CAPABILITY set (process-wide):
    python -m jvllm.testing.deviceless_cli --target h200.txtpb --tiny CKPT_DIR ... --report r.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jvllm.models.loader import read_config
from jvllm.models.quantization import FloatWeights
from jvllm.models.spec import ModelSpec, spec_from_hf_config
from jvllm.testing.deviceless import (
    EIGHT_B,
    GPU_ARCH,
    THROUGHPUT_8B,
    TINY,
    UTILIZATION,
    Target,
    check_fp8_matmul,
    check_model,
    check_tensor_parallel,
    check_unlimited_forward,
    kv_cache_for,
    model_on,
)
from jvllm.testing.deviceless_attention import BAD_LAUNCHES, check_attention, check_bad_launch
from jvllm.testing.deviceless_mla import MLA_BUCKETS, check_mla_decode_kernel, check_mla_stack
from jvllm.testing.deviceless_moe import check_moe_expert_parallel, check_moe_stack
from jvllm.testing.deviceless_variants import STACK_BUCKET, STACKS, check_variant_stack


def eight_b_spec() -> ModelSpec:
    from bench.common import PRESETS

    return spec_from_hf_config(PRESETS["8b"].hf_config() | {"max_position_embeddings": 8192})


def tiny_specs(dirs: list[Path]) -> dict[str, ModelSpec]:
    return {d.name: spec_from_hf_config(read_config(d)) for d in dirs}


# "mla": DeepSeek-V3-shaped, about 12 s a bucket on a quiet machine (CI runs bucket 16;
# `--mla-buckets` picks them).
# "stacks": Gemma-2-9B- and gpt-oss-20b-shaped stacks of 4 layers at one small bucket
# (about 20 s each; the DeepSeek-V3-shaped one is "mla").
# "qwen-vision": a Qwen2.5-VL-7B-shaped vision tower for one 448x448 image (about 7 s).
SECTIONS = (
    *("8b", "tiny", "tp", "bad", "variants", "moe", "mla", "mla-kernel", "stacks"),
    "qwen-vision",
)

# Attention of other models' shapes, the Triton kernel alone at their per-layer options:
# (query heads, KV heads, head dim) and the options of their layers.
ATTENTION_VARIANTS = {
    "gemma-2-9b plain": ((16, 8, 256), {}),  # the same shapes without the variants
    "gemma-2-9b local": ((16, 8, 256), dict(soft_cap=50.0, sliding_window=4096)),
    "gemma-2-9b global": ((16, 8, 256), dict(soft_cap=50.0)),
    "gpt-oss-20b plain": ((64, 8, 64), {}),
    "gpt-oss-20b sliding": ((64, 8, 64), dict(sinks=True, sliding_window=128)),
    "gpt-oss-20b full": ((64, 8, 64), dict(sinks=True)),
}
# (tokens, sequences): a decode step (split key ranges, the merge kernel) and a prefill.
ATTENTION_BUCKETS = ((64, 64), (2048, 16))

# The TP programs keep the 8B shapes but 4 of its 32 layers: every layer compiles to the
# same program, and compile time grows with the layer count.
TP_LAYERS = 4


def run(target: Target, sections: list[str], args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = dict(models=[], tensor_parallel=[], bad_launches={}, variants=[])
    start = time.perf_counter()
    if "8b" in sections:
        spec = eight_b_spec()
        report["models"].append(
            check_model("8b bf16", spec, jnp.bfloat16, EIGHT_B, target, args.buckets, measure=True)
        )
        # The same rule at half the device: the largest bucket is the one that can fail.
        largest = [EIGHT_B.max_num_batched_tokens]
        half = check_model(
            "8b bf16", spec, jnp.bfloat16, EIGHT_B, target, largest, "auto", 0.5, True
        )
        report["sizing_half"] = half
        report["unlimited_forward"] = check_unlimited_forward(spec, EIGHT_B, target)
        # Capped by max_num_seqs x max_model_len: the estimated reserve sizes it as well.
        loaded = model_on(spec, jnp.bfloat16, target.devices())
        size, _, _ = kv_cache_for(loaded, THROUGHPUT_8B, target)
        report["throughput_8b_kv"] = dict(num_blocks=size.num_blocks, kv_tokens=size.num_tokens)
    for i, (arch, spec) in enumerate(tiny_specs(args.tiny).items() if "tiny" in sections else ()):
        for dtype in (jnp.bfloat16, jnp.float32):
            name = f"{arch} {jnp.dtype(dtype).name}"
            report["models"].append(check_model(name, spec, dtype, TINY, target))
        if i == 0:  # the fp8 KV cache's kernels (kv_cache_dtype="fp8"), once
            fp8 = check_model(
                f"{arch} bfloat16 kv-fp8", spec, jnp.bfloat16, TINY, target, None, "fp8"
            )
            report["models"].append(fp8)
    if "tiny" in sections:  # FP8 W8A8 projections: float8 dots on the H200
        w8a8 = FloatWeights("channel", "token")
        fp8_spec = dataclasses.replace(eight_b_spec(), num_layers=1, quantization=w8a8)
        report["fp8_matmul"] = check_fp8_matmul(fp8_spec, target)
    tp_spec = dataclasses.replace(eight_b_spec(), num_layers=TP_LAYERS)
    for topology in args.tp if "tp" in sections else ():
        report["tensor_parallel"].append(
            check_tensor_parallel(tp_spec, topology, args.tp_tokens, target)
        )
    for name, knobs in BAD_LAUNCHES.items() if "bad" in sections else ():
        report["bad_launches"][name] = check_bad_launch(knobs, target)
    for name, (heads, options) in ATTENTION_VARIANTS.items() if "variants" in sections else ():
        for tokens, seqs in ATTENTION_BUCKETS:
            report["variants"] += check_attention(name, heads, tokens, seqs, options, target)
    if "moe" in sections:  # Qwen3-30B-A3B-shaped: 4 layers, 128 experts, top-8
        report["moe"] = check_moe_stack(target)
        report["moe"]["expert_parallel"] = check_moe_expert_parallel(target)
    if "mla" in sections:  # DeepSeek-V3-shaped: latent attention, 256 experts in groups
        report["mla"] = check_mla_stack(target, tuple(args.mla_buckets))
    if "mla-kernel" in sections:  # the Triton MLA decode kernel alone, V3's shapes
        report["mla_kernel"] = check_mla_decode_kernel(target)
    if "stacks" in sections:
        report["stacks"] = [check_variant_stack(name, target, STACK_BUCKET) for name in STACKS]
    if "qwen-vision" in sections:  # window attention, 2-D rotary, patch merger
        from jvllm.testing.deviceless_vision import QWEN2_5_VL_7B, check_qwen_vision_tower

        report["qwen_vision"] = check_qwen_vision_tower(QWEN2_5_VL_7B, target, (448, 448))
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["target"] = dict(memory_bytes=target.memory_bytes, shared_limit=target.shared_limit)
    report["utilization"] = UTILIZATION
    return report


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summary(report: dict[str, Any]) -> str:
    lines = [f"deviceless XLA:GPU compile for an H200 ({GPU_ARCH}), {report['seconds']} s"]
    for m in report["models"]:
        for p in m["programs"]:
            lines.append(
                f"  {m['model']:14} {p['program']:12} {p['label'][:58]:58} {p['seconds']:5.1f} s"
                f"  temp {_mib(p['temp_bytes'])}"
            )
    variants = [dict(model="variants", kernels=report.get("variants", []))]
    variants.append(dict(model="mla", kernels=report.get("mla_kernel", [])))
    variants += report.get("stacks", [])
    for m in report["models"] + report["tensor_parallel"] + variants:
        for k in m["kernels"]:
            lines.append(
                f"  ptxas {k['model']:14} {k['label'][:48]:48} {k['kernel_name']:22} "
                f"{k['registers']:3} regs {k['spill_bytes']} B spilled "
                f"{k['shared_bytes']:6} B smem {'; '.join(k['problems']) or 'ok'}"
            )
    limit = int(report["target"]["memory_bytes"] * report["utilization"])
    for m in report["models"]:
        if m["model"] != "8b bf16":
            continue
        mem = m["memory"]
        lines.append(
            f"  memory 8b: weights {_mib(mem['weight_bytes'])} + KV {mem['num_blocks']} blocks "
            f"+ step {_mib(mem['transient_bytes'])} (reserve {_mib(mem['reserve_bytes'])}) "
            f"= {_mib(mem['peak_bytes'])} of {_mib(limit)}"
        )
        lines.append(f"  GPU KV cache size: {mem['kv_tokens']} tokens (8b, one H200)")
    for key in ("sizing_half", "unlimited_forward"):
        if key in report:
            warnings = report[key]["scheduler_warnings"]
            lines.append(f"  {key}: {len(warnings)} XLA scheduler warnings {warnings[:1]}")
    if "sizing_half" in report:
        mem = report["sizing_half"]["memory"]
        lines.append(
            f"  memory 8b at 0.5: peak {_mib(mem['peak_bytes'])} of {_mib(mem['limit_bytes'])}, "
            f"{mem['kv_tokens']} KV tokens"
        )
    for t in report["tensor_parallel"]:
        lines.append(
            f"  tp={t['tp']} ({t['topology']}, {t['processes']} processes): "
            f"{t['manual_computations']} shard_map bodies, triton q operand "
            f"{t['triton_operands'][0][0]}, collectives {sorted({c[0] for c in t['collectives']})}"
            f", {t['kv_tokens']} KV tokens per replica, {t['seconds']} s"
        )
    for name, kernels in report["bad_launches"].items():
        lines.append(f"  bad launch {name}: {[k['problems'] for k in kernels]}")
    if "moe" in report:
        for layer in report["moe"]["sparse_layer"]:
            lines.append(
                f"  moe sparse layer, {layer['backend']:9}, {layer['num_tokens']:4} tokens: "
                f"{_mib(layer['bytes_accessed'])} accessed; experts {_mib(layer['expert_bytes'])},"
                f" at most {_mib(layer['activated_expert_bytes_max'])} activated; "
                f"dots {layer['expert_dots']}"
            )
            for k in layer["kernels"]:
                lines.append(
                    f"  ptxas moe {k['kernel_name']} T={layer['num_tokens']}: {k['registers']} "
                    f"regs {k['spill_bytes']} B spilled {k['shared_bytes']} B smem "
                    f"{'; '.join(k['problems']) or 'ok'}"
                )
        ep = report["moe"]["expert_parallel"]
        lines.append(
            f"  moe tp=ep={ep['tp']}: {_mib(ep['expert_bytes_per_device'])} of "
            f"{_mib(ep['expert_bytes'])} expert bytes per device, collectives "
            f"{sorted({c[0] for c in ep['collectives']})}, expert weights moved: "
            f"{len(ep['expert_moved'])}"
        )
    for st in report.get("stacks", []):
        lines.append(
            f"  stack {st['model']} {st['num_layers']} layers T={st['num_tokens']}: "
            f"{st['seconds']} s, temp {_mib(st['temp_bytes'])}, {st['cache_arrays']} cache "
            f"arrays (window {st['kv_sliding_window']}), kernels {st['triton_kernels']}"
        )
    if "fp8_matmul" in report:
        dots = report["fp8_matmul"]["dots"]
        float8 = sum(d == ["f8e4m3fn", "f8e4m3fn"] for d in dots)
        lines.append(f"  fp8 W8A8 8b layer: {float8} of {len(dots)} dots take float8 operands")
    return "\n".join(lines)


def predictions(report: dict[str, Any]) -> dict[str, Any]:
    """What a lent H200 should show, for bench/gpu_check.sh to print beside its figures."""
    eight = [m for m in report["models"] if m["model"] == "8b bf16"][0]
    keep = ("model", "label", "kernel_name", "registers", "spill_bytes", "shared_bytes")
    kernels = [k for m in [eight, *report["tensor_parallel"]] for k in m["kernels"]]
    return dict(
        target=f"NVIDIA H200 {GPU_ARCH}, deviceless XLA:GPU (jax {jax.__version__})",
        utilization=report["utilization"],
        kernels=[{key: k[key] for key in keep} for k in kernels],
        kv_cache_8b=dict(eight["memory"], sizes=EIGHT_B._asdict()),
        kv_cache_throughput_8b=dict(report["throughput_8b_kv"], sizes=THROUGHPUT_8B._asdict()),
        tensor_parallel_kv_tokens={
            t["topology"]: t["kv_tokens"] for t in report["tensor_parallel"]
        },
        programs=[
            dict(
                model=p["model"],
                program=p["program"],
                label=p["label"],
                seconds=p["seconds"],
                temp_bytes=p["temp_bytes"],
            )
            for p in eight["programs"]
        ],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="GpuTargetConfigProto text")
    parser.add_argument("--tiny", type=Path, nargs="*", default=[], help="checkpoint dirs")
    parser.add_argument("--buckets", type=int, nargs="*", help="8b token buckets (all if unset)")
    parser.add_argument("--mla-buckets", type=int, nargs="*", default=list(MLA_BUCKETS))
    parser.add_argument("--tp", nargs="*", default=["1x1x2", "1x1x4", "1x1x8", "1x2x1"])
    parser.add_argument("--tp-tokens", type=int, default=64)
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args(argv)
    assert jax_triton_ready(), "set JVLLM_TRITON_COMPUTE_CAPABILITY and install jax-triton"
    target = Target.read(args.target)
    report = run(target, args.sections, args)
    args.report.write_text(json.dumps(report, indent=1))
    print(summary(report), flush=True)


def jax_triton_ready() -> bool:
    import importlib.util

    from jvllm.kernels import jax_triton_attention

    found = importlib.util.find_spec("jax_triton") is not None
    return found and jax_triton_attention.compute_capability() is not None


if __name__ == "__main__":
    main()

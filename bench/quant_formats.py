"""Quantized checkpoint formats side by side: output tokens/s and device bytes of weights.

Every format is the same random-weight preset model (float32): the checkpoint itself
in float32 and bfloat16; compressed-tensors pack-quantized W4A16 (group 32) and W8A16
(per channel) and float-quantized FP8 W8A8 (dynamic per-token inputs), written by the
compressed-tensors library; GPTQ 4-bit (symmetric) and AWQ 4-bit (zero points), laid
out from compressed-tensors' integers, group 128 where it divides every input size
(else 32); DeepSeek-style block FP8 (`quant_method: fp8`); and the float checkpoint
quantized as it loads (`quantization="int8"` and `"fp8"`). The writers are the test
suite's (`tests/models/`), so the bench runs from the repository root; each derived
checkpoint is cached beside the preset's and rewritten when the preset changes.

Each format gets one engine with the throughput bench's sizes for the preset, built
once and kept (build time recorded apart), warmed, then timed on the same greedy
requests (EOS ignored, fixed output lengths) for `--rounds` rounds, each round going
through every format in turn. Reported per format: output tokens/s (each round and the
median), parameter bytes on the device, the linear layers' bytes over a bfloat16
model's, and how often its greedy tokens equal float32's (information only: random
weights give nearly flat logits, so small errors flip tokens).

    python bench/quant_formats.py [--preset cpu] [--num-prompts 64] [--rounds 2]
        [--formats float32,ct-w4a16,...]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

from bench import common
from bench.common import BenchRequest, FlopModel, Preset

Writer = Callable[[Path, Path, Preset], None]  # (float checkpoint, new directory, preset)


class Format(NamedTuple):
    name: str
    description: str
    dtype: str | None  # the engine's dtype; None: the preset's
    quantization: str | None  # quantization at load
    writer: Writer | None  # None: the float checkpoint itself


def legacy_group(preset: Preset) -> int:
    """GPTQ's and AWQ's usual group of 128 inputs, or 32 where 128 does not divide
    every linear layer's input size."""
    inputs = (preset.hidden_size, preset.intermediate_size, preset.num_heads * preset.head_dim)
    return 128 if all(n % 128 == 0 for n in inputs) else 32


def write_ct(spec: Any) -> Writer:
    def write(src: Path, dst: Path, preset: Preset) -> None:
        from tests.models.test_compressed_tensors import compress

        compress(src, dst, spec)

    return write


def write_gptq_awq(layout: str, symmetric: bool) -> Writer:
    def write(src: Path, dst: Path, preset: Preset) -> None:
        from tests.models.legacy_checkpoints import ct_args, write_legacy
        from tests.models.test_compressed_tensors import compress

        case = (layout, 4, legacy_group(preset), symmetric, False)
        args = ct_args(case)
        with tempfile.TemporaryDirectory() as tmp:
            spec = (args.num_bits, args.strategy, args.group_size, args.symmetric)
            ct_dir = compress(src, Path(tmp) / "ct", spec)
            write_legacy(ct_dir, dst, case)

    return write


def write_fp8_block(src: Path, dst: Path, preset: Preset) -> None:
    from tests.models.test_fp8_block import write_fp8

    write_fp8(src, dst)


FORMATS = {
    f.name: f
    for f in [
        Format("float32", "the float32 checkpoint", None, None, None),
        Format("bfloat16", "the float32 checkpoint, dtype=bfloat16", "bfloat16", None, None),
        Format("ct-w4a16", "compressed-tensors pack-quantized int4, group 32, symmetric",
               None, None, write_ct((4, "group", 32))),
        Format("ct-w8a16", "compressed-tensors pack-quantized int8, per channel, symmetric",
               None, None, write_ct((8, "channel", None))),
        Format("ct-fp8", "compressed-tensors FP8_DYNAMIC: fp8 per channel, fp8 tokens",
               None, None, write_ct("FP8_DYNAMIC")),
        Format("gptq-w4", "GPTQ int4, symmetric, no act order, group 128 (or 32: legacy_group)",
               None, None, write_gptq_awq("gptq", True)),
        Format("awq-w4", "AWQ GEMM int4 with zero points, group 128 (or 32: legacy_group)",
               None, None, write_gptq_awq("awq", False)),
        Format("fp8-block", "quant_method fp8: e4m3 weights, a scale per 16x32 block",
               None, None, write_fp8_block),
        Format("int8-load", "float32 checkpoint, quantization='int8' at load",
               None, "int8", None),
        Format("fp8-load", "float32 checkpoint, quantization='fp8' at load", None, "fp8", None),
    ]
}  # fmt: skip


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(common.PRESETS), default="cpu")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, in order")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "quant_formats.json")
    args = p.parse_args(argv)
    for flag in ("num_prompts", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    names = args.formats.split(",")
    unknown = [n for n in names if n not in FORMATS]
    if unknown or len(set(names)) != len(names):
        p.error(f"--formats {args.formats!r}: give each once, from {', '.join(FORMATS)}")
    args.formats = names
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.perf_counter()
    result = common.envelope(__file__, argv)
    import jax

    preset = common.PRESETS[args.preset]
    model_dir = common.build_checkpoint(preset, args.models_dir)
    requests = common.synthetic_workload(preset, args.num_prompts, args.seed)
    source = f"synthetic ShareGPT-shaped lognormal lengths, seed {args.seed}"
    result.update(
        preset=asdict(preset),
        model_dir=str(model_dir),
        backend=jax.default_backend(),
        device=str(jax.devices()[0]),
        workload=common.describe_workload(preset, requests, source),
        engine_args=engine_kwargs(preset),
        legacy_group_size=legacy_group(preset),
        # The preset's Llama has no biases: its linear layers are its matmul parameters.
        bfloat16_linear_bytes=2 * FlopModel.from_preset(preset).linear_params,
    )
    formats = [FORMATS[n] for n in args.formats]
    runs = {f.name: prepare(f, model_dir, preset) for f in formats}
    bf16 = result["bfloat16_linear_bytes"]
    engines = {f.name: build(f, runs[f.name], preset, requests[:4], bf16) for f in formats}
    result["formats"] = time_rounds(engines, runs, requests, args.rounds)
    result["total_s"] = time.perf_counter() - started
    print_table(result)
    common.write_result(args.output, result)
    return result


def engine_kwargs(preset: Preset) -> dict[str, Any]:
    """bench/throughput.py's continuous engine for the preset (block size 16), without
    prefix caching: a later round would find an earlier round's prompt blocks cached.
    Within a round no two random prompts share a block, so nothing else changes."""
    return dict(
        enable_prefix_caching=False,
        block_size=16,
        max_model_len=preset.max_model_len,
        max_num_seqs=preset.max_num_seqs,
        max_num_batched_tokens=preset.max_num_batched_tokens,
        num_gpu_blocks_override=preset.num_kv_blocks,
        scheduling_policy="continuous",
    )


# -- checkpoints and engines -----------------------------------------------------------------


def prepare(fmt: Format, model_dir: Path, preset: Preset) -> dict[str, Any]:
    """The format's checkpoint directory, written unless a matching one is cached."""
    run: dict[str, Any] = dict(description=fmt.description, checkpoint=str(model_dir))
    run.update(convert_s=0.0, dtype=fmt.dtype or preset.dtype, quantization=fmt.quantization)
    run["cached"] = fmt.writer is not None
    if fmt.writer is None:
        return run
    out = model_dir.with_name(f"{model_dir.name}-{fmt.name}")
    source = model_dir / "model.safetensors"
    stamp = json.dumps(
        dict(preset=asdict(preset), format=fmt.name, source_mtime=source.stat().st_mtime_ns),
        sort_keys=True,
    )
    run["checkpoint"] = str(out)
    if (out / "bench_format.json").exists() and (out / "bench_format.json").read_text() == stamp:
        return run
    partial = out.with_name(out.name + ".partial")
    for stale in (out, partial):
        shutil.rmtree(stale, ignore_errors=True)
    common.log(f"{fmt.name}: writing the checkpoint ...")
    run["cached"] = False
    t0 = time.perf_counter()
    fmt.writer(model_dir, partial, preset)
    run["convert_s"] = time.perf_counter() - t0
    (partial / "bench_format.json").write_text(stamp)
    partial.rename(out)
    return run


def build(
    fmt: Format, run: dict[str, Any], preset: Preset, warm: Sequence[BenchRequest], bf16: int
) -> Any:
    """The format's engine, warmed on `warm`; fills in the run's start time, weight
    bytes and linear bytes over `bf16` (a bfloat16 model's)."""
    from jvllm import LLM
    from tests.models.test_quantization import linear_bytes

    common.log(f"{fmt.name}: building the engine (load, KV cache, warm-up compile) ...")
    t0 = time.perf_counter()
    llm = LLM(
        run["checkpoint"],
        dtype=run["dtype"],
        quantization=fmt.quantization,
        **engine_kwargs(preset),
    )
    run["build_s"] = time.perf_counter() - t0
    model = llm.engine.runner.model
    held = model.bytes_per_device()
    run.update(
        weight_bytes=model.weight_bytes,
        weight_bytes_per_device={str(d): n for d, n in held.items()},
        max_device_weight_bytes=max(held.values()),
        linear_bytes=linear_bytes(model),
    )
    run["linear_bytes_over_bfloat16"] = run["linear_bytes"] / bf16
    # The first generate's one-time host work (not compilation) stays out of the rounds.
    timed_generate(llm, [BenchRequest(r.prompt_token_ids, min(r.output_len, 4)) for r in warm])
    run["compilations"] = llm.get_metrics()["num_compilations"]
    run["rounds"] = []
    return llm


def timed_generate(llm: Any, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """`llm.generate` over all requests at once, greedy with fixed output lengths."""
    from jvllm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    wrong = [
        i for i, (t, r) in enumerate(zip(tokens, requests, strict=True)) if len(t) != r.output_len
    ]
    if wrong:
        raise RuntimeError(f"requests {wrong[:5]} did not produce their requested lengths")
    produced = sum(len(t) for t in tokens)
    return dict(
        elapsed_s=elapsed,
        output_tokens=produced,
        output_tokens_per_s=produced / elapsed,
        tokens=tokens,
    )


# -- rounds, summary and report -------------------------------------------------------------


def time_rounds(
    engines: dict[str, Any], runs: dict[str, Any], requests: list[BenchRequest], rounds: int
) -> dict[str, Any]:
    """`rounds` passes over every engine in turn, then each run's summary."""
    for r in range(rounds):
        for name, llm in engines.items():
            common.log(f"round {r + 1}/{rounds}: {name} ...")
            runs[name]["rounds"].append(timed_generate(llm, requests))
    for name, llm in engines.items():
        runs[name] |= summarise(runs[name], runs.get("float32"))
        programs = llm.get_metrics()["num_compilations"]
        runs[name]["new_compilations"] = programs - runs[name]["compilations"]
    for run in runs.values():  # the token lists only fed the agreement figures
        for timed in run["rounds"]:
            del timed["tokens"]
    return runs


def summarise(run: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """Median rate, whether rounds repeat their tokens, and agreement with float32."""
    rounds = run["rounds"]
    out: dict[str, Any] = dict(
        median_output_tokens_per_s=statistics.median(r["output_tokens_per_s"] for r in rounds),
        same_tokens_every_round=all(r["tokens"] == rounds[0]["tokens"] for r in rounds),
        identical_to_float32=None,
        prefix_agreement_with_float32=None,
    )
    if baseline is not None:
        ours, theirs = rounds[0]["tokens"], baseline["rounds"][0]["tokens"]
        same = [a == b for a, b in zip(ours, theirs, strict=True)]
        out["identical_to_float32"] = sum(same) / len(same)
        # Tokens before the first difference, as a fraction of each request's output.
        prefix = [_common_prefix(a, b) / len(a) for a, b in zip(ours, theirs, strict=True)]
        out["prefix_agreement_with_float32"] = sum(prefix) / len(prefix)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def print_table(result: dict[str, Any]) -> None:
    w = result["workload"]
    print(
        f"\n{result['preset']['name']} preset, {w['num_requests']} requests, "
        f"{w['total_output_tokens']} output tokens a round; GPTQ/AWQ group "
        f"{result['legacy_group_size']}; total {result['total_s']:.0f} s"
    )
    rows = []
    for name, r in result["formats"].items():
        agree = r["identical_to_float32"]
        prefix = r["prefix_agreement_with_float32"]
        rows.append([
            name,
            r["convert_s"],
            r["build_s"],
            r["max_device_weight_bytes"] / 2**20,
            r["linear_bytes"] / 2**20,
            r["linear_bytes_over_bfloat16"],
            " / ".join(f"{x['output_tokens_per_s']:.0f}" for x in r["rounds"]),
            r["median_output_tokens_per_s"],
            "-" if agree is None else 100 * agree,
            "-" if prefix is None else 100 * prefix,
        ])  # fmt: skip
    headers = ["format", "convert s", "build s", "device MiB", "linear MiB", "lin/bf16",
               "tok/s rounds", "median tok/s", "% same", "% prefix"]  # fmt: skip
    print(common.format_table(headers, rows))
    print(
        "device MiB: every parameter on the device; lin/bf16: q/k/v/o/gate/up/down bytes over "
        "a bfloat16 model's; % same: requests whose greedy tokens equal float32's; % prefix: "
        "mean share of each output before its first difference"
    )


if __name__ == "__main__":
    main()

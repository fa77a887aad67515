"""Offline throughput, like `vllm bench throughput`, with its baselines in the same run.

One model, one list of prompts and output lengths, three systems: jvllm (continuous
batching over the paged cache), jvllm with `scheduling_policy="static"` at the same KV
memory, and Hugging Face `generate` (left-padded batches at its best batch size, greedy,
EOS ignored so every system produces the same tokens). Prints requests/s and tokens/s,
the ratios, KV utilisation, start time and compilations, the step-time breakdown, and
model FLOP/s against a matmul measured in this process; writes all of it as JSON.

Start time is `LLM(...)` construction (load, KV cache, warm-up compile of every bucket).
With --compilation-cache-dir the first engine fills JAX's persistent cache (cold when
the directory was empty) and the static engine, whose programs are identical, reads it
(warm); without the flag both compile from scratch, which is the control.

    python bench/throughput.py --preset cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import gc
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bench import common
from bench.common import BenchRequest, FlopModel, Preset

# Torch and JAX share the GPU in one process: neither may grab most of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(common.PRESETS), default="cpu")
    p.add_argument("--num-prompts", type=int, help="default: the preset's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", type=Path, help="ShareGPT JSON; default: synthetic lengths")
    p.add_argument("--tokenizer", help="tokenizer that counts --dataset tokens (default: model's)")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-kv-blocks", type=int, help="KV blocks for paged and static alike")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (same KV memory)")
    p.add_argument("--hf-batch-sizes", help="comma-separated; the best one is reported")
    p.add_argument(
        "--hf-search-prompts",
        type=int,
        default=64,
        help="requests each candidate batch size is tried on (0: all)",
    )
    p.add_argument(
        "--preemption-mode",
        choices=("recompute", "swap"),
        default="recompute",
        help="what the continuous engine's preemption does (swap: host memory)",
    )
    p.add_argument(
        "--quantization",
        choices=("int8", "fp8"),
        help="the continuous engine's linear weights quantized at load",
    )
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        help="the continuous engine's speculative decoding, as a JSON object",
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-static", action="store_true")
    p.add_argument("--compilation-cache-dir", type=Path, help="enable JAX's persistent cache")
    p.add_argument("--matmul-size", type=int, help="n of the n^3 yardstick matmul")
    p.add_argument("--output", type=Path, help="default: bench/results/throughput_<preset>.json")
    args = p.parse_args(argv)
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.hf_batch_sizes:
        try:
            args.hf_batch_sizes = tuple(int(s) for s in args.hf_batch_sizes.split(","))
        except ValueError:
            p.error(f"--hf-batch-sizes must be like 8,16,32, got {args.hf_batch_sizes!r}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    cache_entries = None
    if args.compilation_cache_dir is not None:  # before JAX computes anything
        cache_entries = common.enable_compilation_cache(args.compilation_cache_dir)
    import jax

    preset = _resolve_preset(args)
    model_dir = common.build_checkpoint(preset, args.models_dir)
    requests, workload = common.make_workload(
        preset, args.seed, args.dataset, args.tokenizer or str(model_dir)
    )
    _announce(preset, workload)
    flops = FlopModel.from_preset(preset)
    workload["useful_flops"] = flops.workload(requests)
    on_gpu = jax.default_backend() != "cpu"
    common.log("measuring the matmul and copy yardsticks ...")
    yardstick = common.measure_matmul(preset.dtype, args.matmul_size or (8192 if on_gpu else 2048))
    yardstick["copy_bytes_per_s"] = common.measure_copy_bandwidth((4 if on_gpu else 1) << 28)
    result.update(
        preset=preset.__dict__ | {"hf_batch_sizes": list(preset.hf_batch_sizes)},
        model_dir=str(model_dir),
        block_size=args.block_size,
        backend=jax.default_backend(),
        device=str(jax.devices()[0]),
        workload=workload,
        yardstick=yardstick,
        compilation_cache=None
        if cache_entries is None
        else {"dir": str(args.compilation_cache_dir), "entries_before": cache_entries},
    )
    runs: dict[str, Any] = {}
    if not args.skip_hf:
        search = args.hf_search_prompts or len(requests)
        runs["hf"] = run_hf(model_dir, preset, requests, on_gpu, search)
    engine = dict(
        model_dir=model_dir,
        preset=preset,
        requests=requests,
        flops=flops,
        block_size=args.block_size,
    )
    runs["continuous"] = _engine_run(
        **engine,
        policy="continuous",
        preemption_mode=args.preemption_mode,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
    )
    if not args.skip_static:
        blocks = runs["continuous"]["num_kv_blocks"]  # the same KV memory, whatever sized it
        runs["static"] = _engine_run(**engine, policy="static", num_blocks=blocks)
    result["runs"] = runs
    result["summary"] = summarise(result)
    print_report(result)
    common.write_result(
        args.output or common.RESULTS_DIR / f"throughput_{preset.name}.json", result
    )
    return result


def _resolve_preset(args: argparse.Namespace) -> Preset:
    base = common.PRESETS[args.preset]
    changes: dict[str, Any] = {}
    for field in ("num_prompts", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, field) is not None:
            changes[field] = getattr(args, field)
    if args.num_kv_blocks is not None:
        changes["num_kv_blocks"] = args.num_kv_blocks
    elif base.num_kv_blocks is not None and args.block_size != 16:
        # The presets count 16-token blocks; keep their KV memory at another block size.
        changes["num_kv_blocks"] = (base.num_kv_blocks - 1) * 16 // args.block_size + 1
    if args.hf_batch_sizes:
        changes["hf_batch_sizes"] = args.hf_batch_sizes
    return Preset(**(base.__dict__ | changes))


def _announce(preset: Preset, workload: dict[str, Any]) -> None:
    if preset.length_scale != 1.0:
        print(
            f"NOTE: the {preset.name} preset scales ShareGPT's lengths by {preset.length_scale:g} "
            f"(target means {workload['target_mean_input']} in / "
            f"{workload['target_mean_output']} out instead of 161 / 338)"
        )
    print(
        f"workload: {workload['num_requests']} requests, mean {workload['mean_input']:.1f} in / "
        f"{workload['mean_output']:.1f} out (median {workload['median_input']:.0f} / "
        f"{workload['median_output']:.0f}); {workload['source']}"
    )


# -- driving the engine one step at a time ---------------------------------------------------


class StepProbe:
    """Stands in for the engine's runner: times each step's `forward` and `sample` (host
    preparation and the enqueue of the step) and the wait in its `result()`, and records its rows.

    While `probing()` is active it also times the runner's two host-side input builders,
    `pack_rows` and `make_sampling_metadata`, by wrapping them (this process only).
    """

    def __init__(self, runner: Any, flops: FlopModel) -> None:
        self.runner = runner
        self.flops = flops
        self.step: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # num_compilations, copy_blocks, batch_shape...
        return getattr(self.runner, name)

    def forward(self, scheduled: Any) -> None:
        t0 = time.perf_counter()
        self.runner.forward(scheduled)
        rows = scheduled.scheduled
        tokens = sum(len(r.token_ids) for r in rows)
        self.step.update(
            execute_s=time.perf_counter() - t0,
            rows=len(rows),
            tokens=tokens,
            bucket=self.runner.batch_shape(tokens).num_tokens,
            decode=all(len(r.token_ids) == 1 for r in rows),
            flops=sum(
                self.flops.chunk(r.start_position, len(r.token_ids), r.samples) for r in rows
            ),
            kv_tokens=sum(r.start_position + len(r.token_ids) for r in rows),
        )

    def sample(self, sampling: Any) -> Any:
        t0 = time.perf_counter()
        pending = _TimedPending(self.runner.sample(sampling), self)
        self.step["execute_s"] = self.step.get("execute_s", 0.0) + time.perf_counter() - t0
        return pending

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        import jvllm.runner.model_runner as runner_module
        from jvllm.layers import sampler

        saved = runner_module.pack_rows, sampler.make_sampling_metadata
        runner_module.pack_rows = self._timed(saved[0], "pack_rows_s")
        sampler.make_sampling_metadata = self._timed(saved[1], "sampling_metadata_s")
        try:
            yield
        finally:
            runner_module.pack_rows, sampler.make_sampling_metadata = saved

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[key] = self.step.get(key, 0.0) + time.perf_counter() - t0

        return timed


class _TimedPending:
    """A dispatched step whose `result()` wait is added to the probe's current step
    (with async scheduling that is the step after the one that dispatched it)."""

    def __init__(self, pending: Any, probe: StepProbe) -> None:
        self.pending, self.probe = pending, probe

    def result(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self.pending.result()
        finally:
            self.probe.step["wait_s"] = time.perf_counter() - t0


def run_engine(engine: Any, requests: list[BenchRequest], flops: FlopModel) -> dict[str, Any]:
    """Adds every request, then calls `engine.step()` until all finish, sampling the
    engine's metrics after each step. The timing covers adding and stepping."""
    from jvllm import SamplingParams

    probe = StepProbe(engine.runner, flops)
    engine.runner = probe
    programs = probe.num_compilations
    steps: list[dict[str, Any]] = []
    lengths: dict[str, int] = {}
    started = time.perf_counter()
    try:
        for i, r in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params)
        with probe.probing():
            while engine.has_unfinished_requests():
                probe.step = {}
                t0 = time.perf_counter()
                outputs = engine.step()
                wall = time.perf_counter() - t0
                m = engine.get_metrics()
                live, slots = m["num_live_tokens"], m["num_allocated_slots"]
                steps.append(probe.step | dict(wall_s=wall, live=live, allocated=slots))
                for out in outputs:
                    if out.finished:
                        lengths[out.request_id] = len(out.outputs[0].token_ids)
    finally:
        engine.runner = probe.runner
    elapsed = time.perf_counter() - started
    wrong = [i for i, r in enumerate(requests) if lengths.get(str(i)) != r.output_len]
    if wrong:
        raise RuntimeError(f"requests {wrong[:5]} did not produce their requested lengths")
    metrics = engine.get_metrics()
    run = _rates(requests, elapsed) | _summarise_steps(steps, flops)
    run.update(
        compilations_after_warmup=programs,
        new_compilations=metrics["num_compilations"] - programs,
        num_preemptions=metrics["num_preemptions"],
    )
    return run


def _rates(requests: list[BenchRequest], elapsed: float) -> dict[str, float]:
    out = sum(r.output_len for r in requests)
    total = out + sum(len(r.prompt_token_ids) for r in requests)
    return dict(
        elapsed_s=elapsed,
        requests_per_s=len(requests) / elapsed,
        output_tokens_per_s=out / elapsed,
        total_tokens_per_s=total / elapsed,
    )


def _summarise_steps(steps: list[dict[str, Any]], flops: FlopModel) -> dict[str, Any]:
    def total(key: str, chosen: list[dict[str, Any]] = steps) -> float:
        return float(sum(s.get(key, 0) for s in chosen))

    util = [s["live"] / s["allocated"] for s in steps if s["allocated"]]
    decode = [s for s in steps if s.get("decode")]
    step_s, execute_s, wait_s = total("wall_s"), total("execute_s"), total("wait_s")
    host_prep = total("pack_rows_s") + total("sampling_metadata_s")
    decode_s = total("wall_s", decode)
    decode_bytes = len(decode) * flops.weight_bytes + total("kv_tokens", decode) * (
        flops.kv_bytes_per_token
    )
    return dict(
        num_steps=len(steps),
        kv_utilisation=dict(
            mean=sum(util) / len(util), min=min(util), per_step=[round(u, 4) for u in util]
        ),
        per_step=dict(
            rows=[s.get("rows", 0) for s in steps],
            tokens=[s.get("tokens", 0) for s in steps],
            bucket=[s.get("bucket", 0) for s in steps],
            wall_ms=[round(1e3 * s["wall_s"], 3) for s in steps],
        ),
        # execute_s: dispatching steps (input preparation and enqueueing); wait_s: the
        # host waiting for a step's outputs; the rest of step_s is the engine's own work.
        time_split=dict(
            step_s=step_s,
            execute_s=execute_s,
            wait_s=wait_s,
            pack_rows_s=total("pack_rows_s"),
            sampling_metadata_s=total("sampling_metadata_s"),
            device_and_sync_s=execute_s - host_prep + wait_s,
            engine_host_s=step_s - execute_s - wait_s,
        ),
        padding=dict(
            real_tokens=int(total("tokens")),
            bucket_tokens=int(total("bucket")),
            waste_fraction=1 - total("tokens") / max(total("bucket"), 1),
            decode_waste_fraction=1 - total("tokens", decode) / max(total("bucket", decode), 1),
        ),
        step_flops=total("flops"),
        decode=dict(
            steps=len(decode),
            time_s=decode_s,
            mean_rows=total("rows", decode) / max(len(decode), 1),
            flops_per_s=total("flops", decode) / decode_s if decode else 0.0,
            bytes_per_s=decode_bytes / decode_s if decode else 0.0,
        ),
    )


# -- the three systems -----------------------------------------------------------------------


def _engine_run(
    model_dir: Path,
    preset: Preset,
    requests: list[BenchRequest],
    flops: FlopModel,
    block_size: int,
    policy: str,
    num_blocks: int | None = None,
    preemption_mode: str = "recompute",
    quantization: str | None = None,
    speculative_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from jvllm import LLM

    common.log(f"jvllm {policy}: building the engine (load, KV cache, warm-up compile) ...")
    started = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype=preset.dtype,
        block_size=block_size,
        max_model_len=preset.max_model_len,
        max_num_seqs=preset.max_num_seqs,
        max_num_batched_tokens=preset.max_num_batched_tokens,
        num_gpu_blocks_override=num_blocks or preset.num_kv_blocks,
        scheduling_policy=policy,
        preemption_mode=preemption_mode if policy == "continuous" else "recompute",
        quantization=quantization,
        speculative_config=speculative_config,
    )
    start_s = time.perf_counter() - started
    common.log(f"jvllm {policy}: started in {start_s:.1f} s; running {len(requests)} requests ...")
    run = run_engine(llm.engine, requests, flops)
    run.update(
        policy=policy,
        start_s=start_s,
        num_kv_blocks=llm.engine.runner.num_blocks,
        quantization=quantization,
        weight_bytes=llm.engine.runner.model.weight_bytes,
    )
    metrics = llm.get_metrics()
    run["spec_decode"] = {k: v for k, v in metrics.items() if k.startswith("spec_decode_")}
    moved = metrics["num_swapped_out_blocks"] + metrics["num_swapped_in_blocks"]
    spec = llm.engine.runner.spec
    block_bytes = 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim
    block_bytes *= llm.engine.runner.kv_dtype.itemsize
    run["preemption"] = dict(
        mode=preemption_mode if policy == "continuous" else "recompute",
        num_preemptions=metrics["num_preemptions"],
        num_swapped_out_blocks=metrics["num_swapped_out_blocks"],
        num_swapped_in_blocks=metrics["num_swapped_in_blocks"],
        swap_bytes_moved=moved * block_bytes,
        num_recomputed_tokens=metrics["num_recomputed_tokens"],
    )
    del llm
    gc.collect()  # frees the weights and cache before the next engine is built
    return run


def run_hf(
    model_dir: Path, preset: Preset, requests: list[BenchRequest], on_gpu: bool, search: int
) -> dict[str, Any]:
    """`generate` over consecutive left-padded batches, at its best batch size.

    Each candidate size is tried on the first `search` requests; the best one then runs
    the whole workload (reused when the search already covered it). Each batch runs to
    its longest requested output (`min_new_tokens` = `max_new_tokens` keeps EOS from
    ending it early); only each request's own length counts as output.
    """
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, preset.dtype))
    model = model.to(device).eval()
    load_s = time.perf_counter() - started
    _hf_generate(model, requests[:2], device, cap=2)  # one-time setup stays out of the timing
    threads = _pick_torch_threads(model, requests) if device == "cpu" else {}
    subset = requests[:search]
    candidates = []
    for bs in preset.hf_batch_sizes:
        common.log(f"HF generate: batch size {bs} on {len(subset)} requests ...")
        candidates.append(_hf_timed(model, subset, bs, device))
    best = max(candidates, key=lambda c: c["output_tokens_per_s"])
    if len(subset) < len(requests):
        common.log(f"HF generate: batch size {best['batch_size']} on all {len(requests)} ...")
        best = _hf_timed(model, requests, best["batch_size"], device)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return best | dict(
        device=device,
        load_s=load_s,
        torch_threads=torch.get_num_threads(),
        ms_per_step_by_threads=threads,
        candidates=candidates,
    )


def _pick_torch_threads(model: Any, requests: list[BenchRequest]) -> dict[int, float]:
    """Sets torch's thread count to the faster of 1 and its default, timed on one batch.

    On a shared machine torch's OpenMP threads can wait on each other for a whole time
    slice; one thread then runs several times faster. HF gets whichever is faster here.
    """
    import torch

    timings = {}
    for n in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        _hf_generate(model, requests[:8], "cpu", cap=16)
        timings[n] = 1e3 * (time.perf_counter() - t0) / 16
    torch.set_num_threads(min(timings, key=timings.__getitem__))
    return timings


def _hf_timed(model: Any, requests: list[BenchRequest], bs: int, device: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    generated = sum(
        _hf_generate(model, requests[lo : lo + bs], device) for lo in range(0, len(requests), bs)
    )
    elapsed = time.perf_counter() - t0
    useful_out = sum(r.output_len for r in requests)
    return _rates(requests, elapsed) | dict(
        batch_size=bs,
        num_requests=len(requests),
        generated_tokens=generated,
        useful_output_tokens=useful_out,
    )


def _hf_generate(model: Any, batch: list[BenchRequest], device: str, cap: int = 0) -> int:
    """Left-pads one batch and generates its longest output; returns tokens generated."""
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), common.PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids) :] = 1
    new = cap or max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=common.PAD_ID,
        )
    assert out.shape[1] == width + new, (out.shape, width, new)
    return len(batch) * new


# -- summary and report ----------------------------------------------------------------------


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    runs, peak = result["runs"], result["yardstick"]["peak_flops"]
    useful = result["workload"]["useful_flops"]
    out: dict[str, Any] = {}
    for name, run in runs.items():
        rate = useful / run["elapsed_s"]
        out[name] = dict(flops_per_s=rate, roofline_fraction=rate / peak)
        if "step_flops" in run:  # work redone after preemption (recompute) is not useful
            out[name]["recompute_fraction"] = run["step_flops"] / useful - 1
    cont = runs["continuous"]
    ratios = {}
    for base in ("hf", "static"):
        if base in runs:
            ratios[f"continuous_over_{base}"] = (
                cont["output_tokens_per_s"] / runs[base]["output_tokens_per_s"]
            )
    out["ratios"] = ratios
    decode = cont["decode"]
    goals = dict(
        cpu_roofline_ge_60pct=out["continuous"]["roofline_fraction"] >= 0.6,
        decode_steps_roofline_fraction=decode["flops_per_s"] / peak if decode["steps"] else None,
        zero_new_compilations=all(
            runs[k]["new_compilations"] == 0 for k in ("continuous", "static") if k in runs
        ),
        paged_kv_utilisation_ge_95pct=cont["kv_utilisation"]["mean"] >= 0.95,
    )
    if "static" in ratios:
        goals["ge_2x_static"] = ratios["continuous_over_static"] >= 2.0
    if "hf" in runs:
        goals["hf_roofline_fraction"] = out["hf"]["roofline_fraction"]
    out["goals"] = goals
    return out


def print_report(result: dict[str, Any]) -> None:
    runs, summary = result["runs"], result["summary"]
    y = result["yardstick"]
    names = {"continuous": "jvllm continuous", "static": "jvllm static", "hf": "HF generate"}
    rows = []
    for key in ("continuous", "static", "hf"):
        if key not in runs:
            continue
        r = runs[key]
        util = r.get("kv_utilisation", {}).get("mean")
        label = names[key] + (f" (bs {r['batch_size']})" if key == "hf" else "")
        rows.append(
            [
                label,
                r["requests_per_s"],
                r["output_tokens_per_s"],
                r["total_tokens_per_s"],
                r["elapsed_s"],
                summary[key]["flops_per_s"] / 1e9,
                100 * summary[key]["roofline_fraction"],
                "-" if util is None else 100 * util,
            ]
        )
    print()
    print(
        common.format_table(
            [
                "system",
                "req/s",
                "out tok/s",
                "total tok/s",
                "time s",
                "GFLOP/s",
                "% matmul",
                "KV util %",
            ],
            rows,
        )
    )
    print(
        f"yardstick: {y['n']}^3 {y['dtype']} matmul {y['peak_flops'] / 1e9:.1f} GFLOP/s "
        f"(jax {y['jax_flops'] / 1e9:.1f}"
        + (f", torch {y['torch_flops'] / 1e9:.1f}" if "torch_flops" in y else "")
        + f"); copy {y['copy_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    for name, value in summary["ratios"].items():
        print(f"ratio {name.replace('_', ' ')}: {value:.2f}x")
    if "hf" in runs:
        hf = runs["hf"]
        cands = ", ".join(
            f"bs {c['batch_size']}: {c['output_tokens_per_s']:.1f}" for c in hf["candidates"]
        )
        print(
            f"HF output tok/s by batch size on the first {hf['candidates'][0]['num_requests']} "
            f"requests: {cands}; torch threads {hf['torch_threads']} "
            f"(ms/step by threads: {hf['ms_per_step_by_threads']})"
        )
    _print_engine_details(runs)
    print(f"goals: {summary['goals']}")


def _print_engine_details(runs: dict[str, Any]) -> None:
    rows = []
    for key in ("continuous", "static"):
        if key not in runs:
            continue
        r = runs[key]
        t = r["time_split"]
        rows.append(
            [
                key,
                r["start_s"],
                r["compilations_after_warmup"],
                r["new_compilations"],
                r["num_steps"],
                1e3 * t["step_s"] / r["num_steps"],
                100 * t["execute_s"] / t["step_s"],
                100 * t["pack_rows_s"] / t["step_s"],
                100 * t["sampling_metadata_s"] / t["step_s"],
                100 * t["engine_host_s"] / t["step_s"],
                100 * r["padding"]["waste_fraction"],
                r["decode"]["flops_per_s"] / 1e9 if r["decode"]["steps"] else "-",
            ]
        )
    print()
    print(
        common.format_table(
            [
                "engine",
                "start s",
                "programs",
                "new",
                "steps",
                "ms/step",
                "% execute",
                "% pack",
                "% sampl md",
                "% engine",
                "% T padding",
                "decode GFLOP/s",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()

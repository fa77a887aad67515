"""The GPU path built for an NVIDIA H200 in CI, without a GPU (jvllm.testing.deviceless_cli).

The compile runs in subprocesses with their own packages: the CUDA PJRT plugin at this
jax's version, jax-triton, and the triton the GPU machine runs (3.6: triton 3.9 emits
PTX that the CUDA 12.8 ptxas rejects), installed once with `pip install --target` into
~/.cache/jvllm/deviceless and put first on PYTHONPATH, so that this venv's triton (the
interpreter tests need it) stays as it is. Two processes split the work over two cores.
Skipped only when those wheels cannot be installed at all (no network).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[2]
TARGET = Path(__file__).with_name("h200.txtpb")
CACHE = Path(os.environ.get("JVLLM_DEVICELESS_CACHE", Path.home() / ".cache/jvllm/deviceless"))
REQUIREMENTS = (
    f"jax-cuda12-plugin=={jax.__version__}",
    f"jax-cuda12-pjrt=={jax.__version__}",
    "jax-triton==0.3.1",
    "triton==3.6.*",
)
EIGHT_B_BUCKETS = (16, 256, 2048)  # smallest, a middle one, the largest of 16..2048
# The 8B alone takes about as long as the rest.
PROCESSES = (("8b", "mla-kernel", "mla"), ("tiny", "tp", "bad", "moe", "stacks", "qwen-vision"))
MLA_BUCKETS = (16,)  # the DeepSeek-V3 stack at one bucket (~12 s; the CLI runs three)
TIMEOUT_S = 600
DTYPES = ("bfloat16", "float32")


@functools.cache  # one try per session: a failed install is not retried by every test
def deviceless_site() -> tuple[Path | None, str]:
    """The folder holding the wheels, installed on first use (None if pip cannot), and
    how it was found or why not."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    site = CACHE / f"jax-{jax.__version__}-{version}"
    stamp = "\n".join(REQUIREMENTS)
    if (site / "REQUIREMENTS").is_file() and (site / "REQUIREMENTS").read_text() == stamp:
        return site, f"wheels cached in {site}"
    partial = site.with_name(site.name + ".partial")
    for stale in (partial, site):
        shutil.rmtree(stale, ignore_errors=True)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--retries", "2"]
    cmd += ["--target", str(partial)]
    try:
        done = subprocess.run([*cmd, *REQUIREMENTS], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return None, f"pip install {' '.join(REQUIREMENTS)} took over 900 s"
    if done.returncode:
        return None, f"cannot install {' '.join(REQUIREMENTS)}: {done.stderr[-600:]}"
    (partial / "REQUIREMENTS").write_text(stamp)
    partial.rename(site)
    return site, f"installed {' '.join(REQUIREMENTS)} in {time.perf_counter() - start:.0f} s"


def _start(site: Path, sections: tuple[str, ...], tiny: list[Path], out: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    path = [str(site), str(REPO), env.get("PYTHONPATH", "")]
    env |= dict(
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        JAX_PLATFORMS="cpu",  # the CUDA plugin still registers: compile-only devices
        JVLLM_TRITON_COMPUTE_CAPABILITY="90",
    )
    cmd = [sys.executable, "-m", "jvllm.testing.deviceless_cli", "--target", str(TARGET)]
    cmd += ["--sections", *sections, "--report", str(out), "--tiny", *map(str, tiny)]
    cmd += ["--buckets", *map(str, EIGHT_B_BUCKETS), "--mla-buckets", *map(str, MLA_BUCKETS)]
    with open(out.with_suffix(".log"), "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _merge(parts: list[dict]) -> dict:
    report = dict(parts[0], models=[], tensor_parallel=[], bad_launches={})
    for part in parts:
        report["models"] += part["models"]
        report["tensor_parallel"] += part["tensor_parallel"]
        report["bad_launches"] |= part["bad_launches"]
    report["seconds"] = max(p["seconds"] for p in parts)
    kept = ("throughput_8b_kv", "fp8_matmul", "sizing_half", "unlimited_forward", "moe")
    kept += ("stacks", "mla_kernel", "mla", "qwen_vision")
    return report | {k: v for p in parts for k, v in p.items() if k in kept}


@pytest.fixture(scope="module")
def report(checkpoints, tmp_path_factory, pytestconfig) -> dict:
    site, how = deviceless_site()
    if site is None:
        pytest.skip(how)
    tmp = tmp_path_factory.mktemp("deviceless")
    start = time.perf_counter()
    outs = [tmp / f"{'-'.join(s)}.json" for s in PROCESSES]
    procs = [
        _start(site, s, list(checkpoints.values()), o) for s, o in zip(PROCESSES, outs, strict=True)
    ]
    for proc, out in zip(procs, outs, strict=True):
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        assert rc == 0, f"{out.stem}: rc={rc}\n{out.with_suffix('.log').read_text()[-4000:]}"
    from jvllm.testing.deviceless_cli import predictions, summary

    merged = _merge([json.loads(o.read_text()) for o in outs])
    if os.environ.get("JVLLM_DEVICELESS_PREDICTIONS"):  # bench/results/deviceless_h200.json
        predicted = json.dumps(predictions(merged), indent=1)
        Path(os.environ["JVLLM_DEVICELESS_PREDICTIONS"]).write_text(predicted + "\n")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{how}\n{summary(merged)}\n  wall time {time.perf_counter() - start:.0f} s")
    return merged


def _models(report: dict, prefix: str) -> list[dict]:
    return [m for m in report["models"] if m["model"].startswith(prefix)]


def test_every_warm_up_program_compiles(report):
    """Each bucket's forward and all-logprobs program, the sampler, the block copy."""
    names = [m["model"] for m in report["models"]]
    tiny = [f"{a} {d}" for a in ("llama", "mistral", "qwen2", "qwen3") for d in DTYPES]
    tiny.insert(2, "llama bfloat16 kv-fp8")  # the fp8 KV cache, once
    assert names == ["8b bf16", *tiny]
    for m in report["models"]:
        programs = [p["program"] for p in m["programs"]]
        forwards = [p["label"] for p in m["programs"] if p["program"] == "forward"]
        assert len(forwards) == len(m["buckets"]) == programs.count("all_logprobs"), m["model"]
        assert all(f"num_tokens={t}," in f for f, t in zip(forwards, m["buckets"], strict=True)), (
            forwards
        )
        assert "sample" in programs and programs[-1] == "copy", programs
    assert _models(report, "8b")[0]["buckets"] == list(EIGHT_B_BUCKETS)


def test_triton_kernels_neither_spill_nor_overflow_shared_memory(report):
    kernels = [k for m in report["models"] + report["tensor_parallel"] for k in m["kernels"]]
    assert {k["kernel_name"] for k in kernels} == {"paged_attention_kernel", "merge_splits_kernel"}
    bad = [(k["model"], k["label"], k["kernel_name"], k["problems"]) for k in kernels]
    assert [b for b in bad if b[3]] == []
    assert all(0 < k["registers"] <= 255 and k["spill_bytes"] == 0 for k in kernels)


def test_the_check_catches_bad_launch_configurations(report):
    """A test of the test: these launches compile, and only ptxas's report shows why not."""
    spills, smem = report["bad_launches"]["spills"], report["bad_launches"]["smem"]
    assert spills and all(k["spill_bytes"] > 0 for k in spills)
    assert any("spills" in p for k in spills for p in k["problems"])
    assert any(k["shared_bytes"] > k["shared_limit"] for k in smem)
    assert any("shared memory" in p for k in smem for p in k["problems"])


@pytest.mark.parametrize("utilization", [0.9, 0.5])
def test_8b_kv_cache_is_vllms_budget_and_the_compiled_step_fits(report, utilization):
    """vLLM's rule on an H200, as the engine applies it on a GPU: the KV cache gets
    utilization x device memory - weights - the step reserve (measured from the largest
    bucket's compiled programs), in whole blocks; and what XLA compiled, weights and
    that cache plus the step's inputs and every program's temporaries and fresh outputs
    at once, fits in utilization x device memory."""
    checked = _models(report, "8b")[0] if utilization == 0.9 else report["sizing_half"]
    mem = checked["memory"]
    total = report["target"]["memory_bytes"]
    limit = int(total * utilization)
    assert (mem["utilization"], mem["total_bytes"], mem["reserve_measured"]) == (
        utilization,
        total,
        True,
    )
    assert mem["budget_bytes"] == limit - mem["weight_bytes"] - mem["reserve_bytes"], mem
    cache = mem["num_blocks"] * mem["block_bytes"]  # the null block within the budget
    assert mem["budget_bytes"] - mem["block_bytes"] < cache <= mem["budget_bytes"], mem
    # Resident = weights + the cache + the step's inputs (packed metadata, tables).
    inputs = mem["resident_bytes"] - mem["weight_bytes"] - cache
    assert 0 <= inputs < 4 << 20, mem
    # Measured against a two-block cache, exact at the real size: a program's
    # temporaries do not depend on the (donated) cache.
    assert mem["transient_bytes"] + inputs == mem["reserve_bytes"], mem
    assert mem["peak_bytes"] <= limit, mem
    # vLLM reports ~8e5 tokens for Llama-3-8B on an H200 at 0.9.
    assert mem["kv_tokens"] > (500_000 if utilization == 0.9 else 300_000), mem


def test_xla_is_told_the_step_budget_and_no_longer_warns(report):
    """XLA:GPU's scheduler and rematerialization take a program's memory from the
    executable's device_memory_size, which on a GPU XLA's client sets to its allocator's
    limit (utilization x device memory, with the XLA_PYTHON_CLIENT_MEM_FRACTION jvllm
    sets). Without it, on a compile-only device, XLA assumed 80% of the device, which
    the 0.9-sized step's arguments exceed ("an error in the calculation"). Told the
    budget, no program compiles with either warning."""
    control = report["unlimited_forward"]["scheduler_warnings"]
    assert any("exceeds the base limit" in w for w in control), control  # a test of the test
    for m in [*report["models"], report["sizing_half"]]:
        assert m["scheduler_warnings"] == [], (m["model"], m["scheduler_warnings"])


def test_tensor_parallel_attention_runs_on_each_devices_heads(report):
    """TP=2/4/8 in one process and TP=2 over two: attention and the vocab projection are
    shard_map bodies; the Triton kernels get per-device q and caches; only activations
    and logits cross devices."""
    tps = [(t["tp"], t["processes"]) for t in report["tensor_parallel"]]
    assert tps == [(2, 1), (4, 1), (8, 1), (2, 2)]
    for t in report["tensor_parallel"]:
        assert t["manual_computations"] == t["num_layers"] + 1, t["tp"]
        # q, the K and V caches, 3 metadata arrays, the sinks (f32[1] when unused).
        attention = [ops for ops in t["triton_operands"] if len(ops) == 7]
        assert len(attention) == t["num_layers"], t["tp"]
        for q, k_cache, v_cache, *_ in attention:
            assert (q, k_cache, v_cache) == (t["expected_q"], *[t["expected_cache"]] * 2)
        assert t["weight_or_cache_moved"] == [], t["weight_or_cache_moved"][:4]
        assert {op for op, _ in t["collectives"]} <= {"all-reduce", "all-gather"}


def test_fp8_w8a8_projections_multiply_in_float8(report):
    """An 8B-shaped FP8 W8A8 layer (float8 weights per channel, float8 inputs per token)
    as the loader builds it for a GPU: its projections are float8 x float8 dots, which
    XLA:GPU runs as float8 GEMMs on Hopper. XLA merges the dots that share an input
    (q/k/v, gate/up), so one layer has at least 4; no dot takes bf16 operands (the
    cast-up arithmetic's), and the attention's are float32."""
    fp8 = report["fp8_matmul"]
    assert fp8["fp8_matmul"] is True
    float8 = [d for d in fp8["dots"] if d == ["f8e4m3fn", "f8e4m3fn"]]
    assert len(float8) >= 4 * fp8["num_layers"], fp8["dots"]
    assert all(d in (["f8e4m3fn", "f8e4m3fn"], ["f32", "f32"]) for d in fp8["dots"]), fp8


def test_attention_variants_compile_without_spills(tmp_path):
    """The Triton attention alone with Gemma 2's soft cap (16/8 heads of 256, local and
    global layers) and gpt-oss's sinks (64/8 heads of 64, sliding and full layers), at a
    decode step (split key ranges: sinks in the merge) and a prefill, in its own process
    (seconds): ptxas reports no spill and shared memory under the limit; the sinks are
    the attention's seventh operand and the merge's third."""
    site, how = deviceless_site()
    if site is None:
        pytest.skip(how)
    out = tmp_path / "variants.json"
    rc = _start(site, ("variants",), [], out).wait(timeout=TIMEOUT_S)
    assert rc == 0, out.with_suffix(".log").read_text()[-4000:]
    from jvllm.testing.deviceless_cli import ATTENTION_BUCKETS, ATTENTION_VARIANTS

    kernels = json.loads(out.read_text())["variants"]
    attention = [k for k in kernels if k["kernel_name"] == "paged_attention_kernel"]
    assert len(attention) == len(ATTENTION_VARIANTS) * len(ATTENTION_BUCKETS)
    assert any(k["kernel_name"] == "merge_splits_kernel" for k in kernels)
    assert [(k["model"], k["label"], k["problems"]) for k in kernels if k["problems"]] == []
    assert all(0 < k["registers"] <= 255 and k["spill_bytes"] == 0 for k in kernels)
    sinks = [k for k in attention if "'sinks': True" in k["label"]]
    assert sinks and all(k["operands"][6] == "f32[64]" for k in sinks)


def test_moe_stack_compiles_at_every_bucket(report):
    """A Qwen3-30B-A3B-shaped stack (4 layers, 128 experts, top-8): the forward of 16,
    256 and 2048 tokens compiles with the Triton grouped-matmul kernel in place of XLA's
    ragged_dot, which XLA:GPU would expand into dense dots over every expert; the kernel
    neither spills nor overflows shared memory. The bytes one sparse layer accesses with
    either, against the experts' bytes, are in the report (docs/moe.md has them)."""
    moe = report["moe"]
    assert [f["num_tokens"] for f in moe["forwards"]] == [16, 256, 2048]
    for f in moe["forwards"]:
        assert f["expert_dots"] == [] and "grouped_matmul_kernel" in f["triton_kernels"], f
    layers = moe["sparse_layer"]
    assert [(x["backend"], x["num_tokens"]) for x in layers] == [
        (b, t) for b in ("reference", "triton") for t in (16, 256, 2048)
    ]
    for layer in layers:
        dense = layer["backend"] == "reference"
        assert bool(layer["expert_dots"]) == dense, layer
        if dense:  # XLA's dots read every expert's weights, and more
            assert layer["bytes_accessed"] >= layer["expert_bytes"], layer
        else:  # the bytes around the kernel: far below one read of the experts
            assert 0 < layer["bytes_accessed"] < layer["expert_bytes"], layer
    kernels = [k for x in layers for k in x["kernels"]]
    assert {k["kernel_name"] for k in kernels} == {"grouped_matmul_kernel"}
    assert kernels and all(not k["problems"] and k["spill_bytes"] == 0 for k in kernels)


def test_moe_expert_parallel_splits_experts_and_moves_none(report):
    """TP = EP = 4 on a compile-only four-GPU topology: each device holds a quarter of
    the expert bytes, and only activations and logits cross devices."""
    ep = report["moe"]["expert_parallel"]
    assert ep["tp"] == 4 and ep["expert_bytes_per_device"] * 4 == ep["expert_bytes"]
    assert ep["expert_moved"] == []
    assert {op for op, _ in ep["collectives"]} <= {"all-reduce", "all-gather"}


def test_gemma2_and_gpt_oss_stacks_compile_in_the_hybrid_kv_layout(report):
    """Gemma-2-9B- and gpt-oss-20b-shaped stacks of 4 layers at 16 tokens: the Triton
    attention at their options (soft cap and window 4096; sinks and window 128), gpt-oss's
    experts in the grouped matmul, full and sliding layers sharing 2 cache arrays whose
    tables sit side by side, and no kernel spilling or over shared memory."""
    stacks = {s["model"]: s for s in report["stacks"]}
    assert sorted(stacks) == ["gemma-2-9b", "gpt-oss-20b"]
    assert stacks["gemma-2-9b"]["kv_sliding_window"] == 4096
    assert stacks["gpt-oss-20b"]["kv_sliding_window"] == 128
    assert "grouped_matmul_kernel" in stacks["gpt-oss-20b"]["triton_kernels"]
    for s in stacks.values():
        assert (s["num_layers"], s["cache_arrays"], s["table_width"]) == (4, 2, 2 * 8192 // 16)
        assert "paged_attention_kernel" in s["triton_kernels"]
        assert [k["problems"] for k in s["kernels"] if k["problems"]] == []
        assert all(0 < k["registers"] <= 255 for k in s["kernels"])


def test_mla_decode_kernel_builds_at_deepseek_v3_shapes(report):
    """The Triton MLA decode kernel (128 heads, latent 512, rope 64, bf16), split and
    not, with the merge kernel: no spills, shared memory within the H200's."""
    kernels = report["mla_kernel"]
    assert {k["kernel_name"] for k in kernels} == {"mla_decode_kernel", "merge_splits_kernel"}
    assert [k["problems"] for k in kernels if k["problems"]] == []
    assert all(0 < k["registers"] <= 255 and k["spill_bytes"] == 0 for k in kernels)


def test_deepseek_v3_stack_compiles_with_the_mla_kernel(report):
    """A DeepSeek-V3-shaped stack of 4 layers (bf16, "triton" backend): its decode rows
    run the Triton MLA kernel, its experts the grouped matmul, and its latent cache
    block holds 3/256 of a per-head one's bytes (576 against 2 x 128 x 192 a token)."""
    mla = report["mla"]
    assert mla["num_layers"] == 4
    (forward,) = mla["forwards"]
    assert forward["num_tokens"] == MLA_BUCKETS[0] and forward["temp_bytes"] > 0
    assert {"mla_decode_kernel", "grouped_matmul_kernel"} <= set(forward["triton_kernels"])
    assert mla["kv_block_bytes"] * 256 == mla["per_head_block_bytes"] * 3


def test_qwen2_5_vl_vision_tower_compiles(report):
    """A Qwen2.5-VL-7B-shaped tower (32 blocks of 1280, windows of 112 pixels, full
    attention at 7/15/23/31) for one 448x448 image: 32 x 32 patches merged to 256
    embeddings of 3584; its arguments are the bf16 weights and the patches."""
    qwen = report["qwen_vision"]
    assert qwen["output_shape"] == [1, 256, 3584] and qwen["patch_grid"] == [1, 32, 32]
    weights = 2 * (1280 * 1176 + 32 * (4 * 1280**2 + 3 * 1280 * 3420) + 5120**2 + 5120 * 3584)
    assert weights < qwen["argument_bytes"] < weights * 1.02
    assert 0 < qwen["temp_bytes"] < 2**30

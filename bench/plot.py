"""PNG figures from the benchmarks' JSON results (matplotlib, no display needed).

From a `serve.py` result: throughput against request rate, and TTFT / TPOT / ITL / E2E
percentiles against request rate. From a `throughput.py` result: output tokens/s of
jvllm, its static policy and HF `generate`, next to KV utilisation step by step.
Each PNG is written beside its JSON with the same stem.

    python bench/plot.py                       # every bench/results/*.json
    python bench/plot.py bench/results/serve_cpu.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any

from bench import common

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate_axis(runs: list[dict[str, Any]]) -> tuple[list[float], list[str]]:
    """x positions for the rates; `inf` (a burst) sits one step past the largest."""
    finite = [r["request_rate"] for r in runs if r["request_rate"] != "inf"]
    top = max(finite, default=1.0)
    xs = [top * 1.5 if r["request_rate"] == "inf" else r["request_rate"] for r in runs]
    return xs, [f"{r['request_rate']}" for r in runs]


def plot_serve(result: dict[str, Any], stem: Path) -> list[Path]:
    plt = _pyplot()
    runs = sorted(
        result["runs"], key=lambda r: math.inf if r["request_rate"] == "inf" else r["request_rate"]
    )
    xs, labels = _rate_axis(runs)
    title = f"jvllm serve, {result['preset']['name']} preset ({len(runs)} rates)"

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax.plot(xs, [r["total_token_throughput"] for r in runs], "s--", label="total tok/s")
    handles = ax.get_lines()
    if any(r["goodput"] is not None for r in runs):
        twin = ax.twinx()
        twin.plot(xs, [r["goodput"] or 0 for r in runs], "^:", color="gray", label="goodput")
        twin.set_ylabel("goodput (req/s within every SLO)")
        handles += twin.get_lines()
    ax.set(xlabel="request rate (req/s; inf = all at once)", ylabel="tokens/s", title=title)
    ax.set_xticks(xs, labels)
    ax.legend(handles=handles, loc="upper left")
    ax.grid(alpha=0.3)
    paths = [_save(fig, stem.with_name(stem.name + "_throughput.png"))]

    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), sharex=True)
    for ax, (key, name) in zip(axes.flat, LATENCIES, strict=True):
        for stat, style in (("mean", "o-"), ("p50", "s--"), ("p99", "^:")):
            ys = [r[key][stat] for r in runs]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, style, label=stat)
        ax.set(title=name, ylabel="ms")
        ax.set_xticks(xs, labels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("request rate (req/s)")
    fig.suptitle(title)
    paths.append(_save(fig, stem.with_name(stem.name + "_latency.png")))
    return paths


def plot_throughput(result: dict[str, Any], stem: Path) -> list[Path]:
    plt = _pyplot()
    runs = result["runs"]
    names = {"continuous": "jvllm\ncontinuous", "static": "jvllm\nstatic", "hf": "HF\ngenerate"}
    keys = [k for k in ("continuous", "static", "hf") if k in runs]
    fig, (bars, util) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(2, 3))
    values = [runs[k]["output_tokens_per_s"] for k in keys]
    bars.bar([names[k] for k in keys], values, color=["C0", "C1", "C2"][: len(keys)])
    for i, v in enumerate(values):
        bars.annotate(
            f"{v:.0f}\n(jvllm {values[0] / v:.1f}x)" if i else f"{v:.0f}",
            (i, v),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    bars.set(ylabel="output tokens/s", title=f"{result['preset']['name']} preset, same workload")
    bars.margins(y=0.2)
    for key, color in (("continuous", "C0"), ("static", "C1")):
        if key in runs:
            series = runs[key]["kv_utilisation"]["per_step"]
            mean = runs[key]["kv_utilisation"]["mean"]
            util.plot(
                [100 * u for u in series], color=color, lw=1, label=f"{key}: mean {100 * mean:.1f}%"
            )
    util.set(
        xlabel="engine step",
        ylabel="live tokens / allocated KV slots (%)",
        ylim=(0, 105),
        title="KV-cache utilisation",
    )
    util.legend(loc="lower right")
    util.grid(alpha=0.3)
    fig.tight_layout()
    return [_save(fig, stem.with_suffix(".png"))]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    print(f"wrote {path}")
    return path


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("files", nargs="*", type=Path, help="default: bench/results/*.json")
    args = p.parse_args(argv)
    files = args.files or sorted(common.RESULTS_DIR.glob("*.json"))
    written: list[Path] = []
    for file in files:
        result = json.loads(Path(file).read_text())
        kind = result.get("benchmark")
        stem = Path(file).with_suffix("")
        if kind == "serve":
            written += plot_serve(result, stem)
        elif kind == "throughput":
            written += plot_throughput(result, stem)
    if not written:
        print("no serve or throughput results to plot", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()

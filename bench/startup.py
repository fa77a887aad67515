"""Start-up time: cold (nothing cached) and warm (a second start) `LLM(...)` on a preset.

Each start is a fresh process that imports jvllm and builds `LLM(...)` with the preset's
engine arguments (load, KV cache, every program compiled or read from the cache, warm-up
run, tokenizer). A round is one cold start in a new cache directory followed by
`--warm` warm starts in the same directory. With `--baseline-src DIR` (another jvllm
checkout, e.g. a `git worktree` of an older commit) every start is also made with that
source, alternating, so both are measured on the same machine at the same time.

    python bench/startup.py --preset cpu --rounds 2
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--child" in sys.argv:  # the measured checkout's jvllm, ahead of this one (bench imports it)
    sys.path.insert(0, sys.argv[sys.argv.index("--child") + 1])

import argparse
import json
import logging
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from bench import common

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(common.PRESETS), default="cpu")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warm", type=int, default=2, help="warm starts after each cold one")
    p.add_argument("--baseline-src", type=Path, help="another jvllm checkout, run alternately")
    p.add_argument("--output", type=Path, default=ROOT / "bench/results/startup.json")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # SRC MODEL CACHE LAUNCHED
    return p.parse_args(argv)


def child(
    preset: common.Preset, source: str, model_dir: str, cache_dir: str, launched: str
) -> dict[str, Any]:
    """One start in this process with `source`'s jvllm (first on sys.path since the
    script began): seconds per phase."""
    import jvllm
    import jvllm.engine_args as engine_args
    import jvllm.runner.model_runner as model_runner
    from jvllm import LLM

    imported = time.perf_counter()  # import_s: from the parent's launch to here
    phases: dict[str, float] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t

        setattr(owner, name, wrapper)

    compiles = _record_compiles()
    timed(engine_args, "load_model", "load_model_s")
    timed(engine_args, "load_tokenizer", "tokenizer_s")
    timed(model_runner.ModelRunner, "warm_up", "warm_up_s")
    t = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=preset.dtype,
        max_model_len=preset.max_model_len,
        max_num_seqs=preset.max_num_seqs,
        max_num_batched_tokens=preset.max_num_batched_tokens,
        num_gpu_blocks_override=preset.num_kv_blocks,
        compilation_cache_dir=cache_dir,
    )
    built = time.perf_counter()
    runner = llm.llm_engine.runner
    store = getattr(runner, "executable_store", None)
    return dict(
        source=str(Path(jvllm.__file__).parent),
        import_s=time.time() - float(launched) - (built - imported),
        llm_s=built - t,
        **phases,
        cpu_s=time.process_time(),
        programs=runner.num_compilations,
        programs_loaded=None if store is None else store.loaded,
        programs_written=None if store is None else store.written,
        compiles=compiles,
    )


# JAX's log lines for each program it traces, lowers and compiles (at DEBUG unless
# jax_log_compiles), e.g. "Finished XLA compilation of jit(forward) in 0.91 sec".
_PHASES = (
    ("trace", re.compile(r"Finished tracing (\S+) for jit in ([0-9.e+-]+) sec")),
    (
        "lower",
        re.compile(r"Finished jaxpr to MLIR module conversion jit\((.+?)\) in ([0-9.e+-]+) sec"),
    ),
    ("compile", re.compile(r"Finished XLA compilation of jit\((.+?)\) in ([0-9.e+-]+) sec")),
)


def _record_compiles() -> dict[str, dict[str, float]]:
    """Seconds and counts per phase and program ("compile forward", "trace sample", ...)
    summed over this process's JAX log lines, filled in as they come; the lines are
    kept out of the output."""
    totals: dict[str, dict[str, float]] = {}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            for phase, pattern in _PHASES:
                if match := pattern.search(message):
                    program, seconds = match.groups()
                    entry = totals.setdefault(f"{phase} {program}", {"count": 0, "s": 0.0})
                    entry["count"] += 1
                    entry["s"] = round(entry["s"] + float(seconds), 3)

    log = logging.getLogger("jax")
    log.setLevel(logging.DEBUG)
    log.addHandler(Collect(logging.DEBUG))
    log.propagate = False
    return totals


def start(source: Path, model_dir: Path, cache_dir: Path, preset: str) -> dict[str, Any]:
    """One start in a fresh process running `source`'s jvllm; wall time included."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--preset", preset]
    t = time.perf_counter()
    done = subprocess.run(
        [*cmd, "--child", str(source), str(model_dir), str(cache_dir), str(time.time())],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t
    if done.returncode:
        raise RuntimeError(f"start with {source} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"process_s": wall}


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in runs[0] if k.endswith("_s") and all(r.get(k) is not None for r in runs)]
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    preset = common.PRESETS[args.preset]
    if args.child:
        print(json.dumps(child(preset, *args.child)))
        return
    model_dir = common.build_checkpoint(preset, args.models_dir)
    sources = {"jvllm": ROOT}
    if args.baseline_src is not None:
        sources["baseline"] = args.baseline_src.resolve()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"cold": [], "warm": []} for name in sources
    }
    with tempfile.TemporaryDirectory(prefix="jvllm-startup-") as tmp:
        for r in range(args.rounds):
            for name, source in sources.items():
                cache = Path(tmp) / f"{name}-{r}"
                for i in range(1 + args.warm):
                    kind = "cold" if i == 0 else "warm"
                    result = start(source, model_dir, cache, args.preset)
                    runs[name][kind].append(result)
                    common.log(
                        f"{name} {kind}: LLM() {result['llm_s']:.1f} s, process "
                        f"{result['process_s']:.1f} s, {result['programs']} programs "
                        f"({result['programs_loaded']} loaded)"
                    )
    summary = {
        name: {kind: summarize(rs) for kind, rs in kinds.items() if rs}  # --warm 0: no warm
        for name, kinds in runs.items()
    }
    headers = [
        "source",
        "start",
        "LLM() s",
        "process s",
        "CPU s",
        "warm_up s",
        "tokenizer s",
        "import s",
    ]
    rows = [
        [name, kind, s["llm_s"], s["process_s"], s.get("cpu_s"), s.get("warm_up_s"),
         s.get("tokenizer_s"), s["import_s"]]
        for name, kinds in summary.items()
        for kind, s in kinds.items()
    ]  # fmt: skip
    print(common.format_table(headers, rows))
    result = common.envelope("bench/startup.py", argv) | {
        "preset": args.preset,
        "sources": {k: str(v) for k, v in sources.items()},
        "median": summary,
        "runs": runs,
    }
    common.write_result(args.output, result)


if __name__ == "__main__":
    main(sys.argv[1:])

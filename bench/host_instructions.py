"""Host work of one engine decode step as a count of CPU instructions (callgrind).

Wall-clock microseconds on a shared machine vary by 20-50% from one minute to the next;
the instructions a step executes do not. Each measurement is a fresh process under
`valgrind --tool=callgrind` with collection off; it builds `bench/host_overhead.py`'s
engine (no device work, every sequence prefilled), runs a few decode steps, and turns
collection on (`callgrind_control`) for exactly `--steps` `engine.step()` calls. The
figure is instructions per step, less what turning collection on and off costs (counted
in the same process: an empty on/off window dumped first, about half a million);
`PYTHONHASHSEED=0` makes reruns agree
to within a few thousand. With `--baseline-src DIR` (another jvllm checkout, e.g. a `git worktree`
of an older commit) the same engine is also counted with that source's jvllm.

Needs valgrind (`apt-get install valgrind`). A count says how much work a step does,
not how long it takes: at 1024 sequences a step runs at fewer instructions per second
than at 256 (more of what it touches misses the caches).

    python bench/host_instructions.py --baseline-src /tmp/jvllm-base
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import bench  # noqa: F401  (this checkout's bench, before a child puts its source first)

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("cumulative", "delta", "final_only")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", default="256,1024", help="comma-separated running counts")
    p.add_argument("--output-kinds", default=",".join(KINDS), help="comma-separated")
    p.add_argument("--steps", type=int, default=10, help="counted decode steps")
    p.add_argument("--baseline-src", type=Path, help="another jvllm checkout, counted too")
    p.add_argument("--output", type=Path, default=ROOT / "bench/results/host_instructions.json")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # SRC KIND NUM_SEQS STEPS
    args = p.parse_args(argv)
    args.num_seqs = [int(n) for n in args.num_seqs.split(",")]
    args.output_kinds = args.output_kinds.split(",")
    if bad := set(args.output_kinds) - set(KINDS):
        p.error(f"--output-kinds must be among {', '.join(KINDS)}, got {sorted(bad)}")
    if args.steps < 1 or min(args.num_seqs) < 1:
        p.error("--steps and --num-seqs entries must be >= 1")
    return args


def child(source: str, kind: str, num_seqs: int, steps: int) -> None:
    """Runs under callgrind: collection covers exactly `steps` decode steps."""
    sys.path.insert(0, source)  # the measured jvllm
    # The source's own engine set-up: its runner speaks that source's runner protocol.
    spec = importlib.util.spec_from_file_location(
        "host_overhead_measured", Path(source) / "bench" / "host_overhead.py"
    )
    assert spec is not None and spec.loader is not None
    host_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_overhead)
    from jvllm.engine.gc_heap import serving_gc

    args = host_overhead.parse_args(["--num-seqs", str(num_seqs), "--output-kind", kind])
    tokenizer = host_overhead.word_tokenizer(args.vocab_size)
    with serving_gc():
        engine = host_overhead.decoding_engine(host_overhead.Setup(args, num_seqs), tokenizer)
        for _ in range(3):
            engine.step()
        # An empty window, dumped on its own: what the toggles themselves cost.
        _control("-i", "on")
        _control("-i", "off")
        _control("-d")
        _control("-i", "on")
        for _ in range(steps):
            engine.step()
        _control("-i", "off")


def _control(*flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(os.getpid())], check=True, capture_output=True)


def _dumped_total(path: Path) -> int:
    """The instruction total of one callgrind dump file."""
    text = path.read_text()  # "totals:" (older callgrinds write only "summary:")
    match = re.search(r"^totals: (\d+)", text, re.M) or re.search(r"^summary: (\d+)", text, re.M)
    if match is None:
        raise RuntimeError(f"no instruction total in {path}")
    return int(match.group(1))


def count(source: Path, kind: str, num_seqs: int, steps: int) -> tuple[int, int]:
    """Instructions of `steps` engine steps with `source`'s jvllm, and of the on/off
    toggles counted with them."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={tmp}/callgrind.out",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            str(source),
            kind,
            str(num_seqs),
            str(steps),
        ]
        env = dict(os.environ, PYTHONHASHSEED="0")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        match = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode or match is None:
            raise RuntimeError(f"callgrind run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        (toggles,) = [_dumped_total(p) for p in Path(tmp).glob("callgrind.out.*[0-9]")]
    return int(match.group(1)) - toggles, toggles


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        source, kind, num_seqs, steps = args.child
        child(source, kind, int(num_seqs), int(steps))
        return {}
    from bench import common

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (with callgrind_control) is needed: apt-get install valgrind")
    result = common.envelope(__file__, argv)
    sources = {"jvllm": ROOT}
    if args.baseline_src is not None:
        sources["baseline"] = args.baseline_src.resolve()
    result["config"] = dict(
        num_seqs=args.num_seqs,
        output_kinds=args.output_kinds,
        steps=args.steps,
        sources={k: str(v) for k, v in sources.items()},
    )
    toggles: dict[str, int] = {}  # what the on/off calls cost, measured in each run
    result["config"]["toggle_instructions"] = toggles
    rows = []
    for kind in args.output_kinds:
        for n in args.num_seqs:
            row: dict[str, Any] = dict(output_kind=kind, num_seqs=n)
            for name, source in sources.items():
                counted, toggles[name] = count(source, kind, n, args.steps)
                per_step = (counted - toggles[name]) / args.steps
                row[name] = dict(per_step=round(per_step), per_sequence=round(per_step / n))
                common.log(f"{name} {kind} {n} sequences: {per_step / 1e6:.2f} M instructions")
            if "baseline" in row:
                row["ratio"] = row["jvllm"]["per_step"] / row["baseline"]["per_step"]
            rows.append(row)
    result["results"] = rows
    print_report(result)
    common.write_result(args.output, result)
    return result


def print_report(result: dict[str, Any]) -> None:
    from bench import common

    with_base = any("baseline" in r for r in result["results"])
    headers = ["output kind", "sequences", "M instr/step", "instr/sequence"]
    if with_base:
        headers += ["baseline M instr/step", "ratio"]
    table = []
    for r in result["results"]:
        line = [r["output_kind"], r["num_seqs"], r["jvllm"]["per_step"] / 1e6]
        line.append(r["jvllm"]["per_sequence"])
        if with_base:
            line += [r["baseline"]["per_step"] / 1e6, r["ratio"]]
        table.append(line)
    print(common.format_table(headers, table))


if __name__ == "__main__":
    main()

"""The decode forward with the checkpoint's `[out, in]` weights against the CPU layout.

Builds two runners over the `peer` bench model (bench/peer.py's checkpoint): one with
the weights as loaded, one after `process_weights_after_loading` (linear weights and
the lm_head `[in, out]`). For each (rows, context) case every row decodes one token at
that context; the two forwards alternate in one process, and the medians of wall and
process CPU time per forward are reported with the largest logit difference.

    python bench/weight_layout.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from bench import common
from bench.peer import PEER_PRESET
from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import LoadedModel, load_model
from jvllm.models.weight_layout import process_weights_after_loading
from jvllm.runner.model_runner import ModelRunner

BLOCK = 16


class DecodeRow(NamedTuple):  # a runner.input_batch.StepRow
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    prev_step_row: int | None = None
    num_spec_tokens: int = 0
    table_row: int = -1  # none: the block_table list is packed


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default="16x200,48x200,48x400,256x100", help="ROWSxCONTEXT,...")
    p.add_argument("--reps", type=int, default=30, help="timed forwards per layout and case")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "weight_layout.json")
    return p.parse_args(argv)


def make_runner(loaded: LoadedModel, num_blocks: int) -> ModelRunner:
    return ModelRunner(
        loaded,
        num_blocks=num_blocks,
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=1024
        ),
    )


def decode_rows(num_rows: int, context: int) -> list[DecodeRow]:
    rng = np.random.default_rng(0)
    per_row = -(-(context + 1) // BLOCK)
    return [
        DecodeRow(
            [int(rng.integers(4, PEER_PRESET.vocab_size))],
            context,
            list(range(1 + i * per_row, 1 + (i + 1) * per_row)),
        )
        for i in range(num_rows)
    ]


def time_case(runners: dict[str, ModelRunner], rows: list[DecodeRow], reps: int) -> dict:
    logits = {}
    for name, runner in runners.items():  # compile, then settle
        for _ in range(3):
            logits[name] = np.asarray(runner._run_forward(rows)[0])
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(reps):
        for name, runner in runners.items():
            c, t = time.process_time(), time.perf_counter()
            jax.block_until_ready(runner._run_forward(rows)[0])
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    first, second = logits.values()
    return dict(
        wall_ms={n: 1e3 * statistics.median(v) for n, v in wall.items()},
        cpu_ms={n: 1e3 * statistics.median(v) for n, v in cpu.items()},
        max_logit_diff=float(np.abs(first - second).max()),
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    model_dir = common.build_checkpoint(PEER_PRESET, args.models_dir)
    num_blocks = 1 + max(r * -(-(c + 1) // BLOCK) for r, c in cases)
    runners = {
        "out_in": make_runner(load_model(model_dir, attention_backend="cpu"), num_blocks),
        "in_out": make_runner(
            process_weights_after_loading(load_model(model_dir, attention_backend="cpu")),
            num_blocks,
        ),
    }
    result["cases"] = []
    for num_rows, context in cases:
        common.log(f"{num_rows} rows at context {context} ...")
        case = time_case(runners, decode_rows(num_rows, context), args.reps)
        result["cases"].append(dict(rows=num_rows, context=context, **case))
    table = [
        [c["rows"], c["context"], *c["wall_ms"].values(), *c["cpu_ms"].values()]
        for c in result["cases"]
    ]
    headers = ["rows", "context", "wall [out,in]", "wall [in,out]", "cpu [out,in]", "cpu [in,out]"]
    print(common.format_table(headers, table))
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()

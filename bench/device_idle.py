"""How long the device waits for the host under async scheduling.

Runs N greedy requests (default 256, prompts of 64 tokens, 128 outputs, EOS ignored) on
bench/peer.py's random-weight Llama, with async scheduling on or off. For every
dispatched step it records when the host had queued it (the runner's `dispatch`
returned) and, from a watcher thread blocked on its sampled tokens, when the device
finished it. Step N + 1's device work cannot start before it is queued, so the device
idles for max(0, queued(N + 1) - finished(N)): the host's time between steps that the
overlap did not hide. Queued is taken when `dispatch` returns, after the sampler's
call, so the figure is an upper bound. Reported over the decode steps with every
sequence running (the goal: at most 10% of wall time at 256 sequences).

    python bench/device_idle.py [--num-seqs 256] [--no-async]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common
from bench.peer import PEER_PRESET

GOAL_IDLE_FRACTION = 0.10


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, help="default: the engine's")
    p.add_argument("--no-async", action="store_true", help="async_scheduling=False")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "device_idle.json")
    args = p.parse_args(argv)
    if min(args.num_seqs, args.prompt_len, args.output_len) < 1:
        p.error("--num-seqs, --prompt-len and --output-len must be >= 1")
    return args


class StepClock:
    """Wraps a runner's `sample` (which queues the step's last program): each step's
    queued time, its finished time (set by a watcher thread), and how many rows it ran."""

    def __init__(self, runner: Any) -> None:
        self.queued: list[float] = []
        self.finished: list[float] = []
        self.rows: list[int] = []
        self._pending: queue.Queue[Any] = queue.Queue()
        self._forward, self._sample = runner.forward, runner.sample
        runner.forward, runner.sample = self.forward, self.sample
        self._num_rows = 0
        threading.Thread(target=self._watch, daemon=True, name="step-clock").start()

    def forward(self, scheduled: Any) -> None:
        self._forward(scheduled)
        self._num_rows = len(scheduled.scheduled)

    def sample(self, sampling: Any) -> Any:
        pending = self._sample(sampling)
        self.queued.append(time.perf_counter())
        self.rows.append(self._num_rows)
        self._pending.put(pending.out.token_ids)
        return pending

    def _watch(self) -> None:
        # Steps finish in the order they were queued: wait on each in turn (the wait
        # releases the GIL, so the engine thread runs meanwhile).
        while True:
            self._pending.get().block_until_ready()
            self.finished.append(time.perf_counter())

    def wait(self) -> None:
        while len(self.finished) < len(self.queued):
            time.sleep(0.01)


def idle_report(clock: StepClock, num_seqs: int) -> dict[str, Any]:
    queued, finished = np.array(clock.queued), np.array(clock.finished)
    full = [i for i in range(1, len(queued)) if clock.rows[i] == num_seqs == clock.rows[i - 1]]
    gaps = np.maximum(0.0, queued[full] - finished[np.array(full) - 1])
    wall = finished[full[-1]] - finished[full[0] - 1] if full else 0.0
    return dict(
        steps=len(queued),
        full_steps=len(full),
        wall_s=float(wall),
        idle_s=float(gaps.sum()),
        idle_fraction=float(gaps.sum() / wall) if wall else None,
        median_step_ms=float(1e3 * np.median(np.diff(finished[[full[0] - 1, *full]]))),
        median_gap_ms=float(1e3 * np.median(gaps)) if full else None,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from jvllm import LLM, SamplingParams

    result = common.envelope(__file__, argv)
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    model_dir = common.build_checkpoint(PEER_PRESET, args.models_dir)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=PEER_PRESET.max_model_len,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=not args.no_async,
    )
    rng = np.random.default_rng(0)
    low = len(common.SPECIAL_TOKENS)
    prompts = [
        {"prompt_token_ids": rng.integers(low, PEER_PRESET.vocab_size, args.prompt_len).tolist()}
        for _ in range(args.num_seqs)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    clock = StepClock(llm.llm_engine.runner)
    llm.generate(prompts, params, use_tqdm=False)
    clock.wait()
    result["results"] = idle_report(clock, args.num_seqs)
    r = result["results"]
    common.log(
        f"{r['full_steps']} steps with all {args.num_seqs} sequences: device idle "
        f"{1e3 * r['idle_s']:.1f} ms of {r['wall_s']:.2f} s ({100 * r['idle_fraction']:.1f}%), "
        f"median step {r['median_step_ms']:.1f} ms, median gap {r['median_gap_ms']:.2f} ms; "
        f"goal <= {100 * GOAL_IDLE_FRACTION:.0f}%"
    )
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()

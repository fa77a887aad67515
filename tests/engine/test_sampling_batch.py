"""SamplingBatch: a step's sampling columns equal its whole rows' (`step_sampling`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.sampling_batch import SamplingBatch
from jvllm.engine.scheduling.scheduler import Scheduler
from jvllm.engine.sequence_group import SequenceState
from jvllm.engine.step_io import SamplingColumns, SchedulerOutput
from jvllm.engine.structured_output import GrammarCompiler
from jvllm.engine.token_constraints import step_sampling
from jvllm.layers.sampler import make_sampling_metadata
from jvllm.sampling_params import SamplingParams

EOS = frozenset({1})
VOCAB = 64


class _Step:
    """A scheduler and the sequence states of its requests (the engine's two halves)."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.compiler = GrammarCompiler(self.tokenizer, VOCAB, EOS)
        self.scheduler = Scheduler(SchedulerConfig(8, 64, 64), CacheConfig(8), 64)
        self.states: dict[str, SequenceState] = {}
        self.batch = SamplingBatch(num_slots=2)  # grows as slots are taken

    def add(self, request_id: str, params: SamplingParams, seed: int) -> None:
        request = Request(request_id, [5, 6, 7, 8, 9][: 2 + seed % 4], params)
        self.scheduler.add_request(request)
        self.states[request_id] = SequenceState(request, 0, seed, self.tokenizer, EOS, 32)

    def check(self) -> SchedulerOutput:
        """Schedules one step and compares its columns with its whole rows."""
        sched = self.scheduler.schedule()
        states = [self.states[row.request_id] for row in sched.scheduled]
        columns = self.batch.columns(states, sched.scheduled, EOS)
        whole, _ = step_sampling(states, sched.scheduled, EOS, False, self.compiler, VOCAB)
        got = make_sampling_metadata(columns, 12)
        want = make_sampling_metadata(SamplingColumns.from_rows(whole), 12)
        for field in dataclasses.fields(got):
            if field.name != "pending_output":  # read only for penalised rows
                np.testing.assert_array_equal(
                    getattr(got, field.name), getattr(want, field.name), err_msg=field.name
                )
        special = sorted(columns.special)
        np.testing.assert_array_equal(got.pending_output[special], want.pending_output[special])
        return sched


PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "topk": SamplingParams(temperature=0.8, top_k=5, logprobs=2),
    "penalised": SamplingParams(temperature=0.7, repetition_penalty=1.3),
    "min_tokens": SamplingParams(temperature=0.9, min_tokens=2),
    "biased": SamplingParams(temperature=0.0, logit_bias={3: 2.0}),
}


def test_columns_equal_whole_rows_across_decode_steps_and_slot_reuse(tokenizer_dir: Path) -> None:
    step = _Step(tokenizer_dir)
    for seed, (request_id, params) in enumerate(PARAMS.items()):
        step.add(request_id, params, seed)
    sampled = iter(range(10, 10_000))
    for _ in range(4):  # the prefill, then decode rows (each with a placeholder)
        sched = step.check()
        step.scheduler.update_from_output(sched, [next(sampled) for _ in sched.scheduled])
    special = step.batch.needs_row.nonzero()[0].size
    assert special == 3  # penalties, min_tokens, logit bias: plain rows build no SamplingRow
    # A finished request's slot goes to a new request with other parameters.
    freed = step.scheduler.kv_cache_manager.table_array.row("greedy")
    step.scheduler.finish_request("greedy", RequestStatus.FINISHED_STOPPED)
    step.add("seeded", SamplingParams(temperature=0.5, top_p=0.9, seed=3), 11)
    for _ in range(3):
        sched = step.check()
        step.scheduler.update_from_output(sched, [next(sampled) for _ in sched.scheduled])
    assert step.scheduler.kv_cache_manager.table_array.row("seeded") == freed
    assert step.batch.owners[freed] is step.states["seeded"]

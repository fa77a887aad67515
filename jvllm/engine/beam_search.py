"""Beam search groups: which beams live on after each step, and the finished hypotheses.

Owns one beam search request's host-side state and Transformers' beam search rule
(`generate(num_beams=W, do_sample=False)`), step for step:
- every live beam proposes its top K = max(2, 1 + #EOS ids) * W tokens, scored by the
  beam's cumulative log-probability plus the token's (from the log-softmax on device);
- of the best K over all beams, the best W that neither end in EOS nor reach max_tokens
  become the next beams;
- those among the best W that do end join the finished hypotheses, scored
  `cum_logprob / generated_length ** length_penalty`; at most W are kept;
- `early_stopping` decides when no running beam can still beat them (see BeamSearchParams).
The LLM engine feeds it each beam's candidates and asks the scheduler to fork the chosen
beams' KV blocks (`Scheduler.replace_beams`); it never touches blocks or the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from jvllm.config import SchedulerConfig
from jvllm.engine.request import Request
from jvllm.engine.step_io import SamplingRow, ScheduledRequest
from jvllm.engine.token_constraints import Constraints
from jvllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jvllm.sampling_params import (
    NUM_TOP_CANDIDATES,
    BeamSearchParams,
    SamplingParams,
)


class Candidates(NamedTuple):
    """A beam's best next tokens, best first, with their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class Beam:
    """One live beam: a scheduler request whose outputs are the beam's tokens."""

    request: Request
    group_id: str
    cum_logprob: float
    # Per generated position: the candidates the parent beam saw there.
    history: list[Candidates]
    candidates: Candidates | None = None  # set when the beam's row has sampled
    finished: bool = False  # retired: replaced by its children or its group is done
    constraints: Constraints = field(default_factory=Constraints)  # none: beams ban nothing
    plain_sampling: ClassVar[bool] = False  # its rows are `sampling_row`'s (SamplingBatch)
    plain_commit: ClassVar[bool] = False  # its tokens are its group's to choose

    def sampling_row(self, eos_token_ids: frozenset[int], row: ScheduledRequest) -> SamplingRow:
        r = self.request
        return SamplingRow(
            _BEAM_SAMPLING, 0, len(r.output_token_ids), r.prompt_token_ids, r.output_token_ids
        )

    def wants_prompt_logprobs(self, row: ScheduledRequest) -> bool:
        return False


# Greedy with logprobs: the row's top candidates come back with its token.
_BEAM_SAMPLING = SamplingParams(temperature=0.0, max_tokens=None, logprobs=0, ignore_eos=True)


class Hypothesis(NamedTuple):
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    token_ids: list[int]
    cum_logprob: float
    history: list[Candidates]
    finish_reason: str  # "stop" (EOS) or "length"


class Continuation(NamedTuple):
    """A next beam: its parent and the token it adds."""

    parent: Beam
    token_id: int
    cum_logprob: float


def num_candidates(params: BeamSearchParams, eos_token_ids: Sequence[int]) -> int:
    """K, the candidates each beam proposes (Transformers' `beams_to_keep`)."""
    num_eos = 0 if params.ignore_eos else len(set(eos_token_ids))
    return max(2, 1 + num_eos) * params.beam_width


def check_beam_search(
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    scheduler_config: SchedulerConfig,
    num_usable_blocks: int,
    blocks_per_beam: int,
) -> None:
    """ValueError naming the field when this engine cannot run the search: its beams
    must fit the sequence limit, one step's budget and, unshared, the KV cache."""
    width = params.beam_width
    limits = {
        "max_num_seqs": scheduler_config.max_num_seqs,
        "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
        "the beams the KV cache holds unshared": num_usable_blocks // blocks_per_beam,
    }
    for name, limit in limits.items():
        if width > limit:
            raise ValueError(
                f"BeamSearchParams.beam_width={width} exceeds {name} ({limit}): every beam "
                "is a running sequence, scheduled in the same step as its group"
            )
    k = num_candidates(params, eos_token_ids)
    if k > NUM_TOP_CANDIDATES:
        raise ValueError(
            f"BeamSearchParams.beam_width={params.beam_width} with {len(set(eos_token_ids))} "
            f"EOS ids needs {k} candidates per beam, more than the {NUM_TOP_CANDIDATES} the "
            "sampler returns; lower beam_width (or set ignore_eos)"
        )


class BeamGroup:
    """The beams of one beam search request and its finished hypotheses."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = num_candidates(params, sorted(self.eos_token_ids))
        # Generated tokens a beam may reach: max_tokens, or what max_model_len leaves.
        self.max_generated = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.arrival_time = arrival_time
        self.finished: list[Hypothesis] = []  # best first, at most beam_width
        self.num_generated = 0  # tokens every live beam holds
        self._improvable = True  # Transformers' is_early_stop_heuristic_unsatisfied
        self._num_children = 0
        root = self.new_request([])
        self.beams = [Beam(root, request_id, 0.0, [])]

    def new_request(self, output_token_ids: list[int]) -> Request:
        request_id = f"{self.request_id}#beam{self._num_children}"
        self._num_children += 1
        request = Request(
            request_id,
            self.prompt_token_ids,
            _BEAM_SAMPLING,
            self.arrival_time,
            beam_group=self.request_id,
            beam_width=self.params.beam_width,
        )
        request.output_token_ids = output_token_ids
        return request

    def continue_with(self, continuations: list[Continuation]) -> list[Beam]:
        """The next beams, each a new request one token past its parent's; they become
        `beams`. Their KV blocks are the scheduler's business (`replace_beams`)."""
        self.beams = [
            Beam(
                self.new_request([*c.parent.request.output_token_ids, c.token_id]),
                self.request_id,
                c.cum_logprob,
                [*c.parent.history, c.parent.candidates],
            )
            for c in continuations
        ]
        return self.beams

    @property
    def ready(self) -> bool:
        """Whether every live beam has proposed its candidates for this length."""
        return all(b.candidates is not None for b in self.beams)

    def select(self) -> tuple[list[Continuation], bool]:
        """One step of the search over the live beams' candidates: the next beams, best
        first, and whether the search is done (then no beam continues)."""
        assert self.ready, self.request_id
        width, length = self.params.beam_width, self.num_generated + 1
        scored = [
            (beam.cum_logprob + lp, b, rank, token)
            for b, beam in enumerate(self.beams)
            for rank, (token, lp) in enumerate(zip(*beam.candidates, strict=True))
        ]
        # Best K overall; ties go to the earlier beam and its better-ranked token.
        top = sorted(scored, key=lambda c: (-c[0], c[1], c[2]))[: self.num_candidates]
        ends = [token in self.eos_token_ids or length >= self.max_generated for *_, token in top]
        running = [
            Continuation(self.beams[b], token, score)
            for (score, b, _, token), end in zip(top, ends, strict=True)
            if not end
        ][:width]
        full = self.params.early_stopping is True and len(self.finished) == width
        if self._improvable and not full:
            for (score, b, _, token), end in list(zip(top, ends, strict=True))[:width]:
                if end:
                    self._add_hypothesis(self.beams[b], token, score, length)
        self.num_generated = length
        self._improvable = self._improvable and self._can_improve(running)
        full = self.params.early_stopping is True and len(self.finished) == width
        done = not self._improvable or full or all(ends)
        return ([] if done else running), done

    def _add_hypothesis(self, parent: Beam, token: int, cum_logprob: float, length: int) -> None:
        assert parent.candidates is not None
        reason = "stop" if token in self.eos_token_ids else "length"
        hyp = Hypothesis(
            hypothesis_score(cum_logprob, length, self.params.length_penalty),
            [*parent.request.output_token_ids, token],
            cum_logprob,
            [*parent.history, parent.candidates],
            reason,
        )
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones win ties
        del self.finished[self.params.beam_width :]

    def _can_improve(self, running: list[Continuation]) -> bool:
        """Transformers' early-stop heuristic, after this step's selection."""
        if len(self.finished) < self.params.beam_width:
            return True
        if not running:
            return False
        penalty = self.params.length_penalty
        if self.params.early_stopping == "never" and penalty > 0.0:
            length = self.max_generated
        else:
            length = self.num_generated
        return running[0].cum_logprob / length**penalty > self.finished[-1].score

    def output(self, tokenizer: Any, finished: bool = True) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[self._completion(i, h, tokenizer) for i, h in enumerate(self.finished)],
            finished=finished,
        )

    def _completion(self, index: int, hyp: Hypothesis, tokenizer: Any) -> CompletionOutput:
        keep_stop = self.params.include_stop_str_in_output
        ids = hyp.token_ids
        if hyp.finish_reason == "stop" and not keep_stop:
            ids = ids[:-1]  # as vLLM: the EOS that ended the beam is not decoded
        text = tokenizer.decode(ids, skip_special_tokens=not keep_stop)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(hyp.token_ids),
            cumulative_logprob=hyp.cum_logprob,
            logprobs=[_position(t, c) for t, c in zip(hyp.token_ids, hyp.history, strict=True)],
            finish_reason=hyp.finish_reason,
        )


def _position(token: int, cands: Candidates) -> PositionLogprobs:
    """The candidates of one position as logprobs, the chosen token first."""
    entry = {
        t: Logprob(lp, rank + 1)
        for rank, (t, lp) in enumerate(zip(cands.token_ids, cands.logprobs, strict=True))
    }
    return {token: entry.pop(token), **entry}


def hypothesis_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """Transformers' beam score of `length` generated tokens."""
    return cum_logprob / length**length_penalty

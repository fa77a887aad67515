"""Request: one sequence's tokens and scheduling state, and its status.

Owns the per-request counters the scheduler advances. It does not own the request's
KV blocks (the KV cache manager does) nor its text or stop checks (the LLM engine does).
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING

from jvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jvllm.engine.step_io import MultiModalFeature
    from jvllm.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # by recompute: waiting, its K/V dropped
    SWAPPED = enum.auto()  # by swap: its computed blocks in host memory
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str:
        """The OpenAI/vLLM finish reason ("stop", "length", "abort") of a finished status."""
        assert self.is_finished, f"{self} is not a finished status"
        return _FINISH_REASONS[self]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence: its prompt, the tokens sampled so far and how far its K/V is computed.

    `fork_source` names a running sibling with the same prompt whose KV blocks this
    request may share at admission (the n > 1 children of one user request).
    `beam_group` names the beam search request this one is a beam of; the beams of a
    group are scheduled, admitted and preempted together (`Scheduler`), and a beam's next
    token is chosen by its group, not by its own sample (`jvllm.engine.beam_search`).
    `lora_request` names the LoRA adapter it runs with (None: the base model).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        fork_source: str | None = None,
        beam_group: str | None = None,
        beam_width: int = 1,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_features: tuple[MultiModalFeature, ...] = (),
    ) -> None:
        self.request_id = request_id
        # Its images (a vision-language model's): placeholder spans, pixels, hashes.
        self.mm_features = mm_features
        self.lora_request = lora_request
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        # scheduling_policy="priority": lower runs first, ties by arrival (vLLM's rule).
        self.priority = priority
        self.fork_source = fork_source
        self.beam_group = beam_group
        self.beam_width = beam_width
        # A beam whose row has sampled: it waits for its group to choose the next beams.
        self.awaiting_selection = False
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        # Tokens whose K/V are in the cache or being written by a dispatched step; reset
        # to 0 when preempted by recompute (kept when swapped).
        self.num_computed_tokens = 0
        # Decode slots left in its own last block that the KV cache manager has granted
        # (`KVCacheManager.allocate_slot`): a steady decode row takes one without asking.
        self.kv_room = 0
        # Tokens sampled by dispatched steps whose ids the host does not know yet
        # (overlapped scheduling): they follow output_token_ids.
        self.num_output_placeholders = 0
        # Prefix-cache hit tokens at the first admission; None until admitted.
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # Draft tokens a speculative proposer guessed to follow output_token_ids; the
        # next decode row verifies them (they are never part of the sequence).
        self.spec_token_ids: list[int] = []
        # With a draft model: the row of its proposal distributions (on the device) of
        # spec_token_ids[0]; the next ones follow (-1: drafts without a distribution).
        self.spec_q_row = -1
        # The token count that ends it by length (max_tokens outputs, or max_model_len):
        # set by the scheduler that admits it.
        self.max_num_tokens = sys.maxsize

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_outputs_with_placeholders(self) -> int:
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def waits_for_selection(self) -> bool:
        """A beam whose candidates are out (on the device or with its group): its next
        token is not known until the group selects."""
        return self.beam_group is not None and (
            self.awaiting_selection or self.num_output_placeholders > 0
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without concatenating the whole sequence."""
        assert 0 <= start <= stop <= self.num_tokens, (start, stop, self.num_tokens)
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

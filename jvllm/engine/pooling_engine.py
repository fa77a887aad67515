"""PoolingEngine: pooling requests in, PoolingRequestOutputs out, one `step()` at a time.

Owns admitting pooling requests (task, dimensions, truncation and length checks, each a
ValueError naming the field), folding a chunked prompt's steps into one pooled row
(`PooledRows`: first, sum and last per row), and finishing a request once its prompt is
computed: its output is the pooled row through the pooler (Matryoshka truncation, then
L2 normalisation; softmax or sigmoid for class logits). Scheduling is the same
`Scheduler` as generation's: prompts are prefill-only requests under one token budget,
chunked when long; a finished request's blocks are freed at once (kept as prefix-cache
entries only when prefix caching is on). Device work is the runner's (`pool`); host only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from jvllm.config import EngineConfig
from jvllm.engine.metrics import EngineStats, SpecDecodeStats
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.scheduling.scheduler import Scheduler
from jvllm.engine.step_io import PLACEHOLDER_TOKEN, PooledRows, PoolingStepRunner
from jvllm.engine.validation import InvalidRequestError, check_priority, check_token_ids
from jvllm.pooling.config import PoolingModelConfig
from jvllm.pooling.outputs import PoolingOutput, PoolingRequestOutput
from jvllm.pooling.params import PoolingParams
from jvllm.sampling_params import SamplingParams

# The scheduler's view of a pooling request: its prompt, then one step that "samples"
# (the last chunk), after which the engine finishes it.
_PREFILL_ONLY = SamplingParams(max_tokens=1)


@dataclass
class _Pooling:
    """One request's pooling state, folded over its prompt's chunks."""

    request: Request
    params: PoolingParams
    task: str
    text: str | None
    first: np.ndarray | None = None  # [D]: the first token's row
    total: np.ndarray | None = None  # [D]: the sum of every token's row


class NoStructuredOutputs:
    """Pooling requests carry no grammar: what `AsyncLLM` calls on a generating
    engine's grammar compiler, refusing every compile."""

    def compile(self, spec: Any) -> Any:
        raise ValueError("pooling models take no structured_outputs")

    def shutdown(self) -> None:
        pass


class PoolingEngine:
    def __init__(
        self,
        config: EngineConfig,
        pooling: PoolingModelConfig,
        tokenizer: Any,
        runner: PoolingStepRunner,
        num_blocks: int,
        vocab_size: int,
        num_host_blocks: int = 0,
    ) -> None:
        self.config = config
        self.pooling = pooling
        self.tokenizer = tokenizer
        self.runner = runner
        self.vocab_size = vocab_size
        self.max_model_len = config.scheduler_config.max_model_len
        hybrid = getattr(runner, "kv_sliding_window", None)  # a runner's hybrid KV layout
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, num_blocks, num_host_blocks, 0, 0, hybrid
        )
        self.structured_outputs = NoStructuredOutputs()
        self.requests: dict[str, _Pooling] = {}
        self._aborted: list[PoolingRequestOutput[PoolingOutput]] = []
        self.prompt_tokens = 0

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.pooling.supported_tasks

    # -- requests in --

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validates and queues a request; InvalidRequestError names a bad field.
        `priority`: lower first, with scheduling_policy="priority"."""
        check_priority(priority, self.scheduler.scheduler_config.scheduling_policy)
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                f"this pooling model (runner='pooling') serves {list(self.supported_tasks)}, "
                f"not generation: it takes PoolingParams, not {type(params).__name__}",
                "model",
            )
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        task = self._check_task(params)
        text, ids = self._tokenize(prompt)
        ids = self._fit(ids, params.truncate_prompt_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        request = Request(request_id, ids, _PREFILL_ONLY, arrival, priority=priority)
        self.requests[request_id] = _Pooling(request, params, task, text)
        self.scheduler.add_request(request)
        self.prompt_tokens += len(ids)

    def _check_task(self, params: PoolingParams) -> str:
        task = params.task or self.pooling.convert
        if task not in self.supported_tasks:
            raise InvalidRequestError(
                f"task {task!r} is not served by this {self.pooling.convert} model; "
                f"it serves {list(self.supported_tasks)}",
                "task",
            )
        if params.dimensions is not None:
            check_dimensions(params.dimensions, task, self.pooling)
        return task

    def _tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt)) if prompt else []
        if isinstance(prompt, list | tuple):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt)}")

    def _fit(self, ids: list[int], truncate: int | None) -> list[int]:
        """The prompt's last `truncate` tokens (-1: max_model_len), checked."""
        if truncate is not None:
            keep = self.max_model_len if truncate == -1 else truncate
            if keep > self.max_model_len:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens={truncate} is over max_model_len={self.max_model_len}",
                    "truncate_prompt_tokens",
                )
            ids = ids[-keep:]
        if not ids:
            raise InvalidRequestError("prompt is empty: it must hold at least one token", "input")
        check_token_ids(ids, self.vocab_size, "input")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"input has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                "shorten it or set truncate_prompt_tokens",
                "input",
                code="context_length_exceeded",
            )
        return ids

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        data = PoolingOutput(np.zeros(0, np.float32))
        ids = state.request.prompt_token_ids
        self._aborted.append(PoolingRequestOutput(request_id, data, ids, True, 0, state.text))

    # -- one step --

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self, final_only: bool = True) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Runs one step; the outputs of the requests whose prompt it completed (a
        pooling output is always final: `final_only` is `LLMEngine.step`'s signature)."""
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if sched.blocks_to_swap_out:
            self.runner.swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.runner.swap_in(sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            self.runner.copy_blocks(sched.blocks_to_copy)
        if not sched.scheduled:
            self.scheduler.update_from_output(sched, [])
            return outputs
        pooled = self.runner.pool(sched).result()  # the step's one sync
        for i, row in enumerate(sched.scheduled):
            state = self.requests[row.request_id]
            self._fold(state, pooled, i, row.start_position)
            if row.samples:  # its whole prompt is computed: finish it
                outputs.append(self._finish(state, pooled.last[i]))
        # Finished requests are gone from the scheduler; the others sampled nothing.
        self.scheduler.update_from_output(sched, [PLACEHOLDER_TOKEN] * len(sched.scheduled))
        return outputs

    def _fold(self, state: _Pooling, pooled: PooledRows, i: int, start: int) -> None:
        if start == 0 or state.total is None:  # a first chunk (again, after a preemption)
            state.first, state.total = pooled.first[i].copy(), pooled.total[i].copy()
        else:
            state.total += pooled.total[i]

    def _finish(self, state: _Pooling, last: np.ndarray) -> PoolingRequestOutput[PoolingOutput]:
        request = state.request
        del self.requests[request.request_id]
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        kind = self.pooling.pooler.pooling_type
        assert state.total is not None and state.first is not None
        if kind == "LAST":
            row = last
        elif kind == "MEAN":
            row = state.total / request.num_prompt_tokens
        else:
            row = state.first
        data = apply_pooler(row, state.task, state.params, self.pooling)
        return PoolingRequestOutput(
            request.request_id,
            PoolingOutput(data),
            request.prompt_token_ids,
            True,
            request.num_cached_tokens or 0,
            state.text,
        )

    # -- metrics --

    def stats(self) -> EngineStats:
        return EngineStats(
            self.scheduler.stats(),
            SpecDecodeStats(0, 0, 0, []),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=0,
            num_compilations=self.runner.num_compilations,
            weight_version=None,
        )

    def get_metrics(self) -> dict[str, Any]:
        return self.stats().as_dict()


def check_dimensions(dimensions: int, task: str, pooling: PoolingModelConfig) -> None:
    """Matryoshka dimensions: an embedding task on a model that names them."""
    if task not in ("embed", "encode") or pooling.convert != "embed":
        message = f"dimensions apply to embeddings, not to task {task!r}"
        raise InvalidRequestError(message, "dimensions")
    if not pooling.is_matryoshka:
        raise InvalidRequestError(
            f"dimensions={dimensions}: this model does not support Matryoshka representation "
            "(its config.json names no matryoshka_dimensions), so its embeddings cannot be "
            "shortened",
            "dimensions",
        )
    named = pooling.matryoshka_dimensions
    if named is not None and dimensions not in named:
        raise InvalidRequestError(
            f"dimensions={dimensions} is not supported; this model's are {list(named)}",
            "dimensions",
        )
    if dimensions > pooling.hidden_size:
        raise InvalidRequestError(
            f"dimensions={dimensions} is over the model's hidden size {pooling.hidden_size}",
            "dimensions",
        )


def apply_pooler(
    row: np.ndarray, task: str, params: PoolingParams, pooling: PoolingModelConfig
) -> np.ndarray:
    """The pooled row as the task reports it: an embedding (Matryoshka-truncated, then
    L2-normalised), or class probabilities (softmax; sigmoid for one label or a
    multi-label problem); raw with `use_activation=False`."""
    row = row.astype(np.float32)  # [D]
    active = pooling.pooler.activation if params.use_activation is None else params.use_activation
    if pooling.convert == "embed":
        dims = params.dimensions or pooling.pooler.dimensions
        if dims is not None:
            row = row[:dims]
        if active:
            row = row / max(float(np.linalg.norm(row)), 1e-12)
        return row
    if not active:
        return row
    if row.shape[0] == 1 or pooling.problem_type == "multi_label_classification":
        return (1.0 / (1.0 + np.exp(-row))).astype(np.float32)
    shifted = np.exp(row - row.max())
    return (shifted / shifted.sum()).astype(np.float32)

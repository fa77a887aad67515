"""LLM: the offline API, `generate`, `chat` and `beam_search` over a batch of prompts
(a pooling model's `embed`, `classify`, `score`, `encode`: `jvllm.pooling.offline`).

Owns turning a user's batch into engine requests and collecting the finished
outputs in input order, with a progress bar. Everything else is LLMEngine's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jvllm import compat
from jvllm.beam_search import BeamSearchOutput, BeamSearchSequence
from jvllm.engine.beam_search import hypothesis_score
from jvllm.engine.core.offline import create_offline_engine
from jvllm.engine.gc_heap import serving_gc
from jvllm.engine.multimodal import split_image_parts
from jvllm.engine_args import EngineArgs
from jvllm.generation_config import RequestDefaults
from jvllm.lora.request import LoRARequest
from jvllm.outputs import RequestOutput
from jvllm.pooling.offline import PoolingMixin
from jvllm.runner.cpu_binding import bind_cpu_threads
from jvllm.runner.xla_allocator import configure_allocator
from jvllm.sampling_params import BeamSearchParams, SamplingParams
from jvllm.weight_sync import WeightSync, engine_devices

Prompt = str | dict[str, Any]


class LLM(WeightSync, PoolingMixin):
    """`LLM(model="path/to/hf_dir", ...)`; keyword arguments are `EngineArgs` fields, or
    vLLM arguments that have no effect here (`jvllm.compat`, each logged once). Without
    a model, the demo model built into jvllm (`jvllm.demo`) with its engine defaults.
    `mesh=` (a jax Mesh) or `devices=[...]`: the engine on the caller's devices."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is None:
            from jvllm.demo import DEMO_ENGINE_DEFAULTS, demo_model_path

            model, kwargs = str(demo_model_path()), {**DEMO_ENGINE_DEFAULTS, **kwargs}
        kwargs = compat.accept(str(model), engine_devices(kwargs), offline=True)
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM got unknown arguments: {sorted(unknown)}")
        self.engine_args = args = EngineArgs(model=str(model), **kwargs)
        # XLA's allocator reads its settings once, when JAX's backend starts: set them
        # from gpu_memory_utilization before anything can start it.
        configure_allocator(args.gpu_memory_utilization)
        bind_cpu_threads()  # JVLLM_CPU_THREADS_BIND (docs/execution.md)
        # Before the engine: a bad generation_config or max_logprobs fails in a moment.
        self.defaults = RequestDefaults.load(args.generation_config, args.model, args.max_logprobs)
        self.engine = create_offline_engine(args)  # JVLLM_ENABLE_V1_MULTIPROCESSING=1: a process
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> Any:
        """The engine (vLLM's name for it)."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (vLLM's)."""
        return self.defaults.default_sampling_params()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, float]:
        return self.engine.get_metrics()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one per prompt, with scheduling_policy="priority" (lower first);
        `lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        for p in params:
            self.defaults.check_logprobs(p)
        # Every grammar compiles in parallel before the first request enters.
        specs = [p.structured_outputs for p in params if p.structured_outputs is not None]
        for future in [self.engine.structured_outputs.compile(s) for s in specs]:
            future.result()
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        ids = self._add_all(prompts, params, priority, loras)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        prompts = []
        for conv in conversations:
            conv, images = split_image_parts(conv)  # image content parts (vision models)
            text = tokenizer.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            if images:  # the model's processor expands each image's placeholder
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
                continue
            # The template already carries any special tokens it wants.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: Prompt | list[int] | Sequence[Prompt | list[int]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search of every prompt (a string, token ids, or vLLM's prompt dicts) at
        once, each on its own shared KV blocks; the sequences of each output best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        outs = self._run(self._add_all(prompts, [params] * len(prompts)), use_tqdm)
        results = []
        for out in outs:
            sequences = [
                BeamSearchSequence(
                    tokens=out.prompt_token_ids + c.token_ids,
                    logprobs=c.logprobs or [],
                    cum_logprob=c.cumulative_logprob or 0.0,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    score=hypothesis_score(
                        c.cumulative_logprob or 0.0, len(c.token_ids), params.length_penalty
                    ),
                )
                for c in out.outputs
            ]
            results.append(BeamSearchOutput(sequences))
        return results

    def _add_all(
        self,
        prompts: list[Prompt],
        params: Sequence[SamplingParams | BeamSearchParams],
        priority: Sequence[int] | None = None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        self._control.check_serving()  # asleep, or a weight update open: a clear error
        added: list[str] = []
        priorities = [0] * len(prompts) if priority is None else priority
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, rank, lora in zip(prompts, params, priorities, loras, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p, priority=rank, lora_request=lora)
                added.append(request_id)
        except Exception:
            # All or nothing: a bad prompt leaves no half-submitted batch behind.
            for request_id in added:
                self.engine.abort_request(request_id)
            self.engine.step(final_only=True)  # drain the aborted outputs
            raise
        return added

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        with serving_gc():
            while len(done) < len(wanted):
                for out in self.engine.step(final_only=True):
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        rate = out_tokens / max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s")
        bar.close()
        return [done[i] for i in request_ids]


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of one each."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"got {len(loras)} lora_requests for {num_prompts} prompts; pass one, or one per prompt"
        )
    return loras

"""`JvllmRunner` (vLLM's `VllmRunner`, the same name kept as an alias): an `LLM` with
the `generate_*` methods of vLLM's tests, returning their tuple shapes.

Owns turning the runner's calls into `LLM.generate` / `LLM.beam_search` requests and
their outputs into tuples; engine behaviour is the engine's, the comparison rules are
`compare.py`'s. Prompts are strings or token-id lists; a string prompt's text is part
of the returned text (vLLM's convention), a token prompt's is not.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from typing import Any

from jvllm.sampling_params import BeamSearchParams, SamplingParams
from jvllm.testing.compare import Sample

Prompt = str | Sequence[int]


def ask_for_host_devices(count: int) -> None:
    """Asks XLA for `count` CPU host devices (tensor parallelism on a CPU) unless XLA_FLAGS
    already sets a count; no effect on a GPU's devices, nor once JAX's backend started."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _request(prompt: Prompt) -> str | dict[str, list[int]]:
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": [int(t) for t in prompt]}


def _head(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else ""


class JvllmRunner:
    """`with JvllmRunner(model, dtype=..., tensor_parallel_size=...) as jvllm_model:`;
    other keyword arguments go to `LLM` (max_model_len, enforce_eager, ...)."""

    def __init__(
        self,
        model_name: str,
        tokenizer_name: str | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        from jvllm import LLM

        if tokenizer_name is not None:
            kwargs["tokenizer"] = tokenizer_name
        self.llm = LLM(
            str(model_name),
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            **kwargs,
        )
        self.model = self.llm  # the name older vLLM tests use
        self.tokenizer = self.llm.get_tokenizer()

    def __enter__(self) -> JvllmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        del self.llm, self.model
        gc.collect()

    def generate(
        self, prompts: Sequence[Prompt], sampling_params: SamplingParams
    ) -> list[tuple[list[list[int]], list[str]]]:
        """Per prompt: ([prompt + output ids per sequence], [prompt + output text ...])."""
        outs = self.llm.generate([_request(p) for p in prompts], sampling_params, use_tqdm=False)
        return [
            (
                [list(out.prompt_token_ids) + list(c.token_ids) for c in out.outputs],
                [_head(prompt) + c.text for c in out.outputs],
            )
            for prompt, out in zip(prompts, outs, strict=True)
        ]

    def generate_greedy(self, prompts: Sequence[Prompt], max_tokens: int) -> list[Sample]:
        """Per prompt: (prompt + output ids, prompt + output text)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = self.llm.generate([_request(p) for p in prompts], params, use_tqdm=False)
        return [
            Sample(
                (list(out.prompt_token_ids) + list(out.outputs[0].token_ids),
                 _head(prompt) + out.outputs[0].text),
                self.tokenizer,
                len(out.prompt_token_ids),
            )
            for prompt, out in zip(prompts, outs, strict=True)
        ]  # fmt: skip

    def generate_greedy_logprobs(
        self, prompts: Sequence[Prompt], max_tokens: int, num_logprobs: int
    ) -> list[Sample]:
        """Per prompt: (output ids, output text, [{token id: Logprob} per output token]):
        the top `num_logprobs` and the chosen token, as vLLM returns them."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=num_logprobs)
        outs = self.llm.generate([_request(p) for p in prompts], params, use_tqdm=False)
        return [
            Sample((list(c.token_ids), c.text, c.logprobs), self.tokenizer)
            for c in (out.outputs[0] for out in outs)
        ]

    def generate_beam_search(
        self, prompts: Sequence[Prompt], beam_width: int, max_tokens: int
    ) -> list[tuple[list[list[int]], list[str]]]:
        """Per prompt: ([prompt + output ids per beam], [text per beam]), best first."""
        params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens)
        outs = self.llm.beam_search([_request(p) for p in prompts], params)
        return [
            ([list(s.tokens) for s in out.sequences], [_head(p) + s.text for s in out.sequences])
            for p, out in zip(prompts, outs, strict=True)
        ]

    def embed(self, prompts: Sequence[Prompt], *args: Any, **kwargs: Any) -> list[list[float]]:
        """Each prompt's pooled embedding (a `runner="pooling"` model), as vLLM's
        `VllmRunner.embed`; extra arguments go to `LLM.embed`."""
        outputs = self.llm.embed([_request(p) for p in prompts], *args, use_tqdm=False, **kwargs)
        return [list(o.outputs.embedding) for o in outputs]


VllmRunner = JvllmRunner

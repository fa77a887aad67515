"""The offline pooling API: `LLM.encode`, `LLM.embed`, `LLM.classify`, `LLM.score`
(vLLM's signatures and output classes), mixed into `LLM`.

Owns turning a batch into pooling requests, pairing `score`'s two sides (a classifier
reads each pair as one prompt, `tokenizer(text_1, text_2)`, as a cross-encoder; an
embedding model scores the cosine of the two embeddings) and collecting outputs in
input order. Admission, pooling and activations are `PoolingEngine`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jvllm.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from jvllm.pooling.params import PoolingParams

PoolingPrompt = str | list[int] | dict[str, Any]


def pair_token_ids(tokenizer: Any, text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's input: the tokenizer's own pair encoding of the two texts."""
    return list(tokenizer(text_1, text_2)["input_ids"])


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """One `data_1` against every `data_2`, or the two lists pairwise (vLLM's rule)."""
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(
            f"score pairs one text_1 with every text_2, or the two lists one to one; got "
            f"{len(left)} and {len(right)}"
        )
    return list(zip(left, right, strict=True))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


class PoolingMixin:
    """`LLM`'s pooling methods (its `engine` is then a `PoolingEngine`)."""

    engine: Any
    _ids: Any

    def _check_pooling(self, task: str) -> None:
        tasks = getattr(self.engine, "supported_tasks", ())
        if task not in tasks:
            raise ValueError(
                f"LLM.{task} needs a pooling model that serves {task!r} (runner='pooling'); "
                f"this one serves {list(tasks) or ['generate']}"
            )

    def encode(
        self,
        prompts: PoolingPrompt | Sequence[PoolingPrompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Every prompt's pooled row (`outputs.data`), for `pooling_task` (default: the
        model's own)."""
        self._check_pooling(pooling_task or "encode")
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = pooling_params if pooling_params is not None else PoolingParams()
        every = [params] * len(prompts) if isinstance(params, PoolingParams) else list(params)
        if len(every) != len(prompts):
            raise ValueError(f"got {len(every)} PoolingParams for {len(prompts)} prompts")
        changes: dict[str, Any] = {"task": pooling_task} if pooling_task else {}
        if truncate_prompt_tokens is not None:
            changes["truncate_prompt_tokens"] = truncate_prompt_tokens
        every = [p.clone(**changes) for p in every]
        return self._run_pooling(prompts, every, use_tqdm)

    def embed(
        self,
        prompts: PoolingPrompt | Sequence[PoolingPrompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        self._check_pooling("embed")
        outs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="embed",
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PoolingPrompt | Sequence[PoolingPrompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        self._check_pooling("classify")
        outs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="classify",
        )
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each pair, or an embedding model's cosine."""
        pairs = score_pairs(data_1, data_2)
        params = pooling_params or PoolingParams()
        if "score" in getattr(self.engine, "supported_tasks", ()):
            tokenizer = self.engine.tokenizer
            prompts = [
                {"prompt": f"{a}\n{b}", "prompt_token_ids": pair_token_ids(tokenizer, a, b)}
                for a, b in pairs
            ]
            outs = self.encode(
                prompts,  # type: ignore[arg-type]
                params,
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
                pooling_task="score",
            )
            return [ScoringRequestOutput.from_base(o) for o in outs]
        self._check_pooling("embed")
        texts = [t for pair in pairs for t in pair]
        embedded = self.encode(texts, params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, pooling_task="embed")  # fmt: skip
        results = []
        for i in range(len(pairs)):
            a, b = embedded[2 * i], embedded[2 * i + 1]
            data = np.array([cosine(a.outputs.data, b.outputs.data)], np.float32)
            base = PoolingRequestOutput(
                a.request_id, PoolingOutput(data), a.prompt_token_ids + b.prompt_token_ids, True
            )
            results.append(ScoringRequestOutput.from_base(base))
        return results

    def _run_pooling(
        self, prompts: list[PoolingPrompt], params: list[PoolingParams], use_tqdm: bool
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                added.append(request_id)
        except Exception:
            for request_id in added:  # all or nothing
                self.engine.abort_request(request_id)
            self.engine.step()  # drain the aborted outputs
            raise
        wanted, done = set(added), {}
        bar = tqdm(total=len(added), desc="Processed prompts", disable=not use_tqdm)
        while len(done) < len(wanted):
            for out in self.engine.step():
                if out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in added]

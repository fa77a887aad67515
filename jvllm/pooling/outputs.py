"""What a pooling model hands back (vLLM's classes and field names).

`PoolingRequestOutput.outputs.data` is the pooled row as a numpy array (vLLM's is a
torch tensor); the task views wrap it: `EmbeddingRequestOutput.outputs.embedding`,
`ClassificationRequestOutput.outputs.probs`, `ScoringRequestOutput.outputs.score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass
class PoolingOutput:
    data: np.ndarray  # [D] float32: an embedding, class probabilities or logits


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        embedding = EmbeddingOutput(out.outputs.data.tolist())
        return cls(out.request_id, embedding, out.prompt_token_ids, out.finished,
                   out.num_cached_tokens, out.prompt)  # fmt: skip


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> ClassificationRequestOutput:
        probs = ClassificationOutput(out.outputs.data.tolist())
        return cls(out.request_id, probs, out.prompt_token_ids, out.finished,
                   out.num_cached_tokens, out.prompt)  # fmt: skip


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> ScoringRequestOutput:
        data = out.outputs.data
        if data.shape != (1,):
            raise ValueError(f"a score is one number; the model gave {data.shape[0]} per input")
        score = ScoringOutput(float(data[0]))
        return cls(out.request_id, score, out.prompt_token_ids, out.finished,
                   out.num_cached_tokens, out.prompt)  # fmt: skip

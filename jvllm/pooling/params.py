"""PoolingParams: what one pooling request asks for (vLLM's names).

Owns the per-request knobs and their range checks. Checks that need the model (its
tasks, its hidden size, Matryoshka sizes, max_model_len) are the pooling engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TASKS = ("encode", "embed", "classify", "score")


@dataclass(frozen=True)
class PoolingParams:
    """`task`: "embed", "classify", "score" (a classifier over a text pair) or "encode"
    (the model's own output); None: the model's task. `dimensions`: keep the first this
    many embedding dimensions (Matryoshka), then normalise. `use_activation`: normalise
    embeddings, softmax (sigmoid) class logits; None: the pooler's default.
    `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: max_model_len); None:
    a prompt longer than max_model_len is refused."""

    task: str | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        k = self.truncate_prompt_tokens
        if k is not None and (k == 0 or k < -1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {k}")

    def clone(self, **changes: object) -> PoolingParams:
        return replace(self, **changes)  # type: ignore[arg-type]

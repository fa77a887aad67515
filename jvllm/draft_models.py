"""Speculative decoding's draft model: loaded and checked against its target.

Owns loading a draft checkpoint and refusing one that cannot serve its target (another
vocabulary or tokenizer, fewer positions than max_model_len). Not the EAGLE head's
loading (`models/eagle.py`) nor the engine's wiring (`engine_args.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from jvllm.models.loader import LoadedModel, load_model
from jvllm.models.weight_layout import process_weights_after_loading, transposes_weights
from jvllm.tokenizer_loading import load_tokenizer

logger = logging.getLogger("jvllm")


def load_draft(
    path: str | None,
    dtype: str,
    backend: str,
    mesh: Any,
    target: LoadedModel,
    max_model_len: int,
    target_tokenizer: str,
) -> LoadedModel:
    """The draft model of speculative decoding, checked against the target: the same
    vocabulary (size and, where the draft has a tokenizer, the same token ids) and room
    for max_model_len positions."""
    assert path is not None
    draft = load_model(path, dtype, backend, mesh)
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise ValueError(
            f"speculative_config model {path!r}: its vocabulary has {draft.spec.vocab_size} "
            f"tokens, the target's {target.spec.vocab_size}; a draft model must share the "
            "target's tokenizer"
        )
    check_draft_length(path, draft, max_model_len)
    if transposes_weights(draft.spec, mesh):
        draft = process_weights_after_loading(draft)
    check_draft_tokenizer(path, target_tokenizer)
    logger.info("Draft model: %s (%.1f MiB)", path, draft.weight_bytes / 2**20)
    return draft


def check_draft_tokenizer(path: str, target_tokenizer: str) -> None:
    """Where the draft has a tokenizer, it must give every token the target's id."""
    if not any(Path(path).glob("tokenizer*")):
        return
    ours = load_tokenizer(path).get_vocab()
    theirs = load_tokenizer(target_tokenizer).get_vocab()
    if ours != theirs:
        raise ValueError(
            f"speculative_config model {path!r}: its tokenizer maps tokens to other ids "
            "than the target's; a draft model must share the target's tokenizer"
        )


def check_draft_length(path: str, draft: LoadedModel, max_model_len: int) -> None:
    if draft.spec.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config model {path!r}: max_position_embeddings="
            f"{draft.spec.max_position_embeddings} is shorter than max_model_len="
            f"{max_model_len}; lower max_model_len"
        )

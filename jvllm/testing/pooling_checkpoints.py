"""Random-weight pooling checkpoints: a decoder with a sentence-transformers layout (an
embedder) and `*ForSequenceClassification` models, for tests and the pooling bench.

Every norm weight is perturbed away from its init constant of 1, so a pooler that
skipped the final norm would not match Transformers. Imports nothing of jvllm but
`checkpoints.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jvllm.testing.checkpoints import (
    _config,
    copy_tokenizer,
    make_checkpoint,
    tokenizer_special_ids,
)


def perturb_norms(model: Any, seed: int) -> None:
    """Adds N(0, 0.3) to every norm weight of a torch model, in place."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def write_sentence_transformers(path: Path, hidden: int, mode: str) -> None:
    """A sentence-transformers layout over the checkpoint in `path`: Transformer,
    Pooling(`mode`: "lasttoken", "mean_tokens", "cls_token"), Normalize."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{kind}"}
        for i, (p, kind) in enumerate(kinds)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    for sub in ("1_Pooling", "2_Normalize"):
        (path / sub).mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, f"pooling_mode_{mode}": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))


def make_embedder(
    out: Path, tokenizer_dir: Path, arch: str = "qwen3", mode: str = "lasttoken", **overrides: Any
) -> Path:
    """A causal LM with a sentence-transformers layout and Matryoshka sizes 16, 32, 64."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(arch, out, tokenizer_dir, **overrides)
    model = AutoModelForCausalLM.from_pretrained(path)
    perturb_norms(model, 1)
    model.config.matryoshka_dimensions = [16, 32, 64]
    model.save_pretrained(path)
    write_sentence_transformers(path, model.config.hidden_size, mode)
    return path


def make_classifier(out: Path, tokenizer_dir: Path, arch: str, num_labels: int) -> Path:
    """A `*ForSequenceClassification` checkpoint of `arch` with `num_labels` labels."""
    import torch
    from transformers import AutoModelForSequenceClassification

    vocab, special = tokenizer_special_ids(tokenizer_dir)
    config = _config(arch, vocab, special, {"num_labels": num_labels})
    torch.manual_seed(2)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    perturb_norms(model, 3)
    model.save_pretrained(out)
    copy_tokenizer(tokenizer_dir, out)
    return out

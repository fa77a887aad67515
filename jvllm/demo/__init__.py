"""The demo model: a small Llama trained on Debian's fortune cookies, shipped in the package.

`jvllm serve` and `LLM()` run it when given no model. This package owns where it lives,
its name and the engine limits it is served with; `corpus`, `tokenizer`, `train` and
`export` rebuild it (`python -m jvllm.demo.train --out DIR`); an EAGLE-1 head trained
for it ships beside it (`demo_eagle_path()`, `python -m jvllm.demo.train_eagle`), for
speculative decoding. Importing this module
imports neither jax nor the training code.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

DEMO_NAME = "jvllm-demo"
DEMO_MODEL_DIR = Path(__file__).parent / "model"
DEMO_EAGLE_DIR = Path(__file__).parent / "eagle"
# Engine defaults for the demo, applied unless the caller sets them: its context is 1024
# positions (trained on 256), and it is small enough that CPU float32 is the fast path.
DEMO_ENGINE_DEFAULTS: dict[str, Any] = dict(
    max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512, dtype="float32"
)


def demo_model_path() -> Path:
    """The shipped checkpoint directory; a clear error if the package lacks it."""
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo model is missing from {DEMO_MODEL_DIR}; reinstall jvllm, or "
            "rebuild it with `python -m jvllm.demo.train --out " + str(DEMO_MODEL_DIR) + "`"
        )
    return DEMO_MODEL_DIR


def demo_eagle_path() -> Path:
    """The shipped EAGLE-1 head for the demo model (speculative_config's "model")."""
    if not (DEMO_EAGLE_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo EAGLE head is missing from {DEMO_EAGLE_DIR}; reinstall jvllm, or "
            "rebuild it with `python -m jvllm.demo.train_eagle --out " + str(DEMO_EAGLE_DIR) + "`"
        )
    return DEMO_EAGLE_DIR


@cache
def training_report() -> dict[str, Any]:
    """Provenance of the shipped weights: corpus, size, steps, held-out loss."""
    return json.loads((demo_model_path() / "training.json").read_text())


def demo_description() -> str:
    r = training_report()
    return (
        f"DEMO: a {r['parameters'] / 1e6:.1f}M-parameter Llama built into jvllm, trained on "
        f"Debian's fortune cookies (held-out perplexity {r['held_out_perplexity']})"
    )


@cache
def corpus_words() -> frozenset[str]:
    """The lower-case words of the training corpus, shipped beside the checkpoint."""
    return frozenset((demo_model_path() / "words.txt").read_text().split())

"""The demo model: a small Llama trained on Debian's fortune cookies, shipped in the package.

`jvllm serve` and `LLM()` run it when given no model. This package owns where it lives,
its name and the engine limits it is served with; `corpus`, `tokenizer`, `train` and
`export` rebuild it (`python -m jvllm.demo.train --out DIR`); an EAGLE-1 head, an EAGLE-3
head and Medusa heads trained for it ship beside it (`demo_eagle_path()`,
`demo_eagle3_path()`, `demo_medusa_path()`; `python -m jvllm.demo.train_eagle`,
`train_eagle3`, `train_medusa`), for speculative decoding, and a speculative_config
naming "eagle", "eagle3" or "medusa" without a model uses them on the demo model
(`with_shipped_head`). Importing this module
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
DEMO_MEDUSA_DIR = Path(__file__).parent / "medusa"
DEMO_EAGLE3_DIR = Path(__file__).parent / "eagle3"
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


def demo_medusa_path() -> Path:
    """The shipped Medusa heads for the demo model (speculative_config's "model")."""
    if not (DEMO_MEDUSA_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo Medusa heads are missing from {DEMO_MEDUSA_DIR}; reinstall jvllm, or "
            "rebuild them with `python -m jvllm.demo.train_medusa --out "
            + str(DEMO_MEDUSA_DIR)
            + "`"
        )
    return DEMO_MEDUSA_DIR


def demo_eagle3_path() -> Path:
    """The shipped EAGLE-3 head for the demo model (speculative_config's "model")."""
    if not (DEMO_EAGLE3_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo EAGLE-3 head is missing from {DEMO_EAGLE3_DIR}; reinstall jvllm, or "
            "rebuild it with `python -m jvllm.demo.train_eagle3 --out " + str(DEMO_EAGLE3_DIR) + "`"
        )
    return DEMO_EAGLE3_DIR


def with_shipped_head(speculative: dict[str, Any], model: str | None) -> dict[str, Any]:
    """`speculative` (vLLM's speculative_config dict) with the demo's shipped head as its
    "model" where it names "eagle", "eagle3" or "medusa" without one and `model` is the
    demo."""
    heads = {"eagle": demo_eagle_path, "eagle3": demo_eagle3_path, "medusa": demo_medusa_path}
    method = speculative.get("method")
    if method not in heads or speculative.get("model") is not None or model is None:
        return speculative
    if Path(model).resolve() != DEMO_MODEL_DIR.resolve():
        return speculative
    return {**speculative, "model": str(heads[method]())}


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

"""A checkpoint's tokenizer and end-of-sequence ids, as the engine loads them.

Owns `load_tokenizer` (AutoTokenizer's choice, loading the generic fast tokenizer
directly where AutoTokenizer would pick it anyway) and `eos_token_ids` (the model's,
the tokenizer's and generation_config.json's). Not the engine's wiring
(`engine_args.py`).
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
from pathlib import Path
from typing import Any

from jvllm.models.spec import ModelSpec

# Model types whose checkpoints Transformers 5's AutoTokenizer gives the generic fast
# tokenizer when their tokenizer_config.json names a generic class (`load_tokenizer`);
# not qwen2, which it gives Qwen2Tokenizer whatever the file says.
_GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen3"})
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


# Transformers resolves its names lazily on first use; two threads doing that at once can
# see a half-imported module ("cannot import name 'AutoTokenizer'"): the engine loads the
# tokenizer on a thread while the main thread loads a draft model, which checks its
# tokenizer too. Tokenizers load one at a time.
_TRANSFORMERS_LOCK = threading.Lock()


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, as `AutoTokenizer.from_pretrained` loads it.

    Where AutoTokenizer would pick the generic fast tokenizer anyway (a tokenizer.json, a
    generic `tokenizer_class`, no custom code, a model type without a tokenizer of its
    own), that class is loaded directly: AutoTokenizer's import also imports torch,
    seconds of a start that serving never uses."""
    try:
        with _TRANSFORMERS_LOCK:
            if _loads_generic_tokenizer(Path(path)):
                from transformers import PreTrainedTokenizerFast

                return PreTrainedTokenizerFast.from_pretrained(path)
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from None


def _loads_generic_tokenizer(path: Path) -> bool:
    if int(importlib.metadata.version("transformers").split(".")[0]) < 5:
        return False
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(tokenizer_config, dict) and isinstance(config, dict)):
        return False  # AutoTokenizer says what is wrong with them
    return (
        (path / "tokenizer.json").is_file()
        and tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and config.get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES
    )


def eos_token_ids(model_dir: Path, spec: ModelSpec, tokenizer: Any) -> set[int]:
    ids = set(spec.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids

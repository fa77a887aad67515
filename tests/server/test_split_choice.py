"""Which models the server runs in engine-core processes: a vision-language model stays
in-process (images do not cross the split), and a front end of the split refuses images
with a 400-kind error rather than dropping them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from jvllm.engine.core.client import _tokenize
from jvllm.engine.core.env import takes_images
from jvllm.engine.validation import InvalidRequestError
from jvllm.server.split import split_refusal


def _checkpoint(root: Path, architecture: str) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return root


def _args(model: Path) -> SimpleNamespace:
    return SimpleNamespace(model=str(model), num_processes=None, runner="auto", convert="auto")


def test_a_vision_language_model_is_served_in_process(tmp_path, monkeypatch):
    monkeypatch.delenv("JVLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    llava = _checkpoint(tmp_path / "llava", "LlavaForConditionalGeneration")
    llama = _checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    assert takes_images(llava) and not takes_images(llama) and not takes_images(None)
    assert "vision-language" in split_refusal(_args(llava), None)
    assert split_refusal(_args(llama), None) is None


def test_the_split_front_end_refuses_images_instead_of_dropping_them():
    prompt = {"prompt": "<image> what is this?", "multi_modal_data": {"image": object()}}
    with pytest.raises(InvalidRequestError) as e:
        _tokenize(None, prompt)
    assert e.value.param == "multi_modal_data" and "text only" in str(e.value)

"""Where `jvllm serve` runs the engine: in engine-core processes unless the environment
says 0, the host has too few cores for a process of its own (unless told 1, or the
layout needs it), or the model is a vision-language one (images do not cross the split);
a front end of the split refuses images with a 400-kind error rather than dropping them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from jvllm.engine.core.client import _tokenize
from jvllm.engine.core.env import takes_images
from jvllm.engine.validation import InvalidRequestError
from jvllm.server import split
from jvllm.server.process_args import DataParallelConfig, ProcessConfig
from jvllm.server.split import split_refusal


def _checkpoint(root: Path, architecture: str) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return root


def _args(model: Path) -> SimpleNamespace:
    return SimpleNamespace(model=str(model), num_processes=None, runner="auto", convert="auto")


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv("JVLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(split, "usable_cpus", lambda: 16)
    return monkeypatch


def test_a_vision_language_model_is_served_in_process(tmp_path, unset):
    llava = _checkpoint(tmp_path / "llava", "LlavaForConditionalGeneration")
    llama = _checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    assert takes_images(llava) and not takes_images(llama) and not takes_images(None)
    assert "vision-language" in split_refusal(_args(llava), None)
    assert split_refusal(_args(llama), None) is None


def test_a_small_host_keeps_the_engine_in_process_unless_told_or_needed(tmp_path, unset):
    llama = _args(_checkpoint(tmp_path / "llama", "LlamaForCausalLM"))
    unset.setattr(split, "usable_cpus", lambda: 2)
    assert "2 usable CPU cores" in split_refusal(llama, None)
    two_engines = ProcessConfig(data_parallel=DataParallelConfig(data_parallel_size=2))
    assert split_refusal(llama, two_engines) is None
    assert split_refusal(llama, ProcessConfig(api_server_count=2)) is None
    unset.setenv("JVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert split_refusal(llama, None) is None
    unset.setenv("JVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert "=0" in split_refusal(llama, None)
    with pytest.raises(ValueError, match="need the split"):
        split_refusal(llama, two_engines)


def test_the_split_front_end_refuses_images_instead_of_dropping_them():
    prompt = {"prompt": "<image> what is this?", "multi_modal_data": {"image": object()}}
    with pytest.raises(InvalidRequestError) as e:
        _tokenize(None, prompt)
    assert e.value.param == "multi_modal_data" and "text only" in str(e.value)

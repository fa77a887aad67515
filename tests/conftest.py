"""Shared fixtures: a locally trained tokenizer and tiny checkpoints of every architecture."""

from __future__ import annotations

import os
from pathlib import Path

# Eight CPU devices for the tensor-parallel tests; must precede jax's backend start.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

from importlib.metadata import entry_points

import pytest

from jvllm.testing import ARCHITECTURES, make_checkpoint, make_tokenizer

# The pytest plugin (hf_runner, jvllm_runner, ...) loads through its entry point once
# jvllm is installed; a checkout installed before the entry point existed loads it here.
if not entry_points(group="pytest11", name="jvllm"):
    pytest_plugins = ["jvllm.testing.pytest_plugin"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """arch -> float32 checkpoint directory."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {a: make_checkpoint(a, root / a, tokenizer_dir) for a in ARCHITECTURES}


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict:
    """mixture-of-experts arch -> float32 checkpoint with the Hub's per-expert names."""
    from jvllm.testing.moe_checkpoints import MOE_ARCHITECTURES, make_moe_checkpoint

    root = tmp_path_factory.mktemp("moe")
    return {a: make_moe_checkpoint(a, root / a, tokenizer_dir) for a in MOE_ARCHITECTURES}


@pytest.fixture(scope="session")
def hf_models(checkpoints: dict[str, Path]) -> dict:
    """arch -> the Transformers reference model (torch, CPU, float32, eval)."""
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(path).eval() for a, path in checkpoints.items()}


@pytest.fixture(params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param

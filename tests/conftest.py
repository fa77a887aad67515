"""Shared fixtures: a locally trained tokenizer and tiny checkpoints of every architecture."""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
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


# A worker that dies (a segmentation fault, an abort) takes its fault handler's dump with
# it into the middle of a long log; each xdist worker writes that dump to its own file
# instead, and the controller prints what any worker wrote at the end of the run, less
# the test harness's frames.
_HARNESS = ("/_pytest/", "/pluggy/", "/xdist/", "/execnet/", 'File "<string>"')


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    config = node.config
    if not hasattr(config, "_crash_dumps"):
        config._crash_dumps = Path(tempfile.mkdtemp(prefix="jvllm-crash-dumps-"))
    node.workerinput["crash_dumps"] = str(config._crash_dumps)


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler set-up
def pytest_configure(config: pytest.Config) -> None:
    dumps = getattr(config, "workerinput", {}).get("crash_dumps")
    if dumps:
        path = Path(dumps) / f"{config.workerinput['workerid']}-{os.getpid()}.txt"
        config._crash_dump = path.open("w")
        faulthandler.enable(file=config._crash_dump, all_threads=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    dump = getattr(config, "_crash_dump", None)
    if dump is not None:  # a worker ending normally leaves no file behind
        faulthandler.disable()
        dump.close()
        Path(dump.name).unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    dumps = getattr(config, "_crash_dumps", None)
    if dumps is None:
        return
    for path in sorted(dumps.glob("*.txt")):
        lines = [
            line
            for line in path.read_text(errors="replace").splitlines()
            if not line.startswith("Extension modules") and not any(h in line for h in _HARNESS)
        ]
        if lines:
            terminalreporter.write_sep("=", f"a worker died: its fault handler wrote ({path.name})")
            for line in lines[:300]:
                terminalreporter.write_line(line[:300])
    shutil.rmtree(dumps, ignore_errors=True)


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

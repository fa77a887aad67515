"""jvllm's pytest plugin: vLLM-style model tests against Transformers, in any project.

Registered by installing jvllm (the `pytest11` entry point `jvllm`; `-p no:jvllm` turns
it off). Owns:
- fixtures `hf_runner`, `jvllm_runner` (and `vllm_runner`, the same), each the runner
  class with this run's defaults bound, and `example_prompts`;
- options `--jvllm-model PATH` (repeatable: a test that takes a `model` argument it does
  not parametrize itself runs once per checkpoint, and is skipped without one),
  `--jvllm-reference PATH` (the Transformers checkpoint `hf_runner` loads instead, one
  per --jvllm-model: for a converted or re-exported model), `--jvllm-dtype` (both
  runners' default dtype) and `--jvllm-tp` (the jvllm runner's tensor_parallel_size);
- the `gpu` marker: such tests are skipped unless JAX will run on an NVIDIA GPU.
Nothing heavy is imported until a fixture is used: collecting a suite costs no torch/jax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jvllm.testing.compare import EXAMPLE_PROMPTS
from jvllm.testing.jvllm_runner import ask_for_host_devices


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jvllm", "jvllm: compare with Transformers")
    group.addoption(
        "--jvllm-model",
        action="append",
        default=[],
        metavar="PATH",
        help="checkpoint directory to run each test that takes `model` on (repeatable)",
    )
    group.addoption(
        "--jvllm-reference",
        action="append",
        default=[],
        metavar="PATH",
        help="Transformers checkpoint hf_runner loads in place of the matching --jvllm-model",
    )
    group.addoption("--jvllm-dtype", default="auto", help="the runners' default dtype")
    group.addoption(
        "--jvllm-tp", type=int, default=1, help="the jvllm runner's tensor_parallel_size"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")
    models, references = config.getoption("jvllm_model"), config.getoption("jvllm_reference")
    if references and len(references) != len(models):
        raise pytest.UsageError(
            f"--jvllm-reference given {len(references)} times for {len(models)} --jvllm-model; "
            "give one per model, in the same order"
        )
    tp = config.getoption("jvllm_tp")
    if tp < 1:
        raise pytest.UsageError(f"--jvllm-tp must be >= 1, got {tp}")
    ask_for_host_devices(tp)


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        names = names.split(",") if isinstance(names, str) else names
        if name in [n.strip() for n in names]:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`model` (when no parametrize mark or fixture supplies it): one test per checkpoint."""
    if "model" not in metafunc.fixturenames or _parametrizes(metafunc, "model"):
        return
    fixture_info = getattr(metafunc.definition, "_fixtureinfo", None)
    if fixture_info is not None and fixture_info.name2fixturedefs.get("model"):
        return  # the project's own `model` fixture wins
    models = metafunc.config.getoption("jvllm_model")
    if models:
        metafunc.parametrize("model", models, ids=[str(m) for m in models])
    else:
        skip = pytest.mark.skip(reason="no checkpoint: pass --jvllm-model PATH")
        metafunc.parametrize("model", [pytest.param(None, marks=skip)], ids=["no-model"])


def gpu_available() -> bool:
    """Whether JAX runs on an NVIDIA GPU here, answered without starting its backend
    where it has not started (jvllm sets XLA's allocator before it starts)."""
    from jvllm.runner.xla_allocator import backend_started, gpu_intended

    if backend_started():
        import jax

        return jax.default_backend() == "gpu"
    devices = list(Path("/proc/driver/nvidia/gpus").glob("*")) + list(
        Path("/dev").glob("nvidia[0-9]*")
    )
    return gpu_intended() and bool(devices)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if marked and not gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU and a CUDA jaxlib")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def example_prompts() -> list[str]:
    return list(EXAMPLE_PROMPTS)


@pytest.fixture(scope="session")
def hf_runner(pytestconfig: pytest.Config) -> Callable[..., Any]:
    """The HfRunner class, with --jvllm-dtype as its default dtype and --jvllm-reference
    in place of the matching --jvllm-model."""
    from jvllm.testing.hf_runner import HfRunner

    models = pytestconfig.getoption("jvllm_model")
    references = dict(zip(models, pytestconfig.getoption("jvllm_reference"), strict=False))

    def make(model_name: str, **kwargs: Any) -> HfRunner:
        kwargs.setdefault("dtype", pytestconfig.getoption("jvllm_dtype"))
        return HfRunner(references.get(str(model_name), model_name), **kwargs)

    return make


@pytest.fixture(scope="session")
def jvllm_runner(pytestconfig: pytest.Config) -> Callable[..., Any]:
    """The JvllmRunner class, with --jvllm-dtype and --jvllm-tp as its defaults."""
    from jvllm.testing.jvllm_runner import JvllmRunner

    return functools.partial(
        JvllmRunner,
        dtype=pytestconfig.getoption("jvllm_dtype"),
        tensor_parallel_size=pytestconfig.getoption("jvllm_tp"),
    )


@pytest.fixture(scope="session")
def vllm_runner(jvllm_runner: Callable[..., Any]) -> Callable[..., Any]:
    """jvllm_runner, under the name vLLM's tests use."""
    return jvllm_runner

"""Whether the engine runs in an engine-core process: `JVLLM_ENABLE_V1_MULTIPROCESSING`
(or vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING`), 1 or 0. Imports nothing: `LLM` and the
server ask before anything of the split (msgspec, zmq) is imported."""

from __future__ import annotations

import json
import os

MULTIPROCESSING_ENV = ("JVLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING")


# Below this many usable CPU cores `jvllm serve` keeps the engine in-process unless told
# otherwise: the core process would share the few cores the front end and the engine's
# own compute threads use (on 2 cores the split gave 0.91x the output tok/s at saturation).
MIN_CPUS_FOR_SPLIT = 4


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity, as a container limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def multiprocessing_choice() -> bool | None:
    """The environment's choice (1 or 0; jvllm's name first), None when unset."""
    for name in MULTIPROCESSING_ENV:
        value = os.environ.get(name)
        if value is not None:
            if value not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {value!r}")
            return value == "1"
    return None


def multiprocessing_enabled(default: bool) -> bool:
    """The environment's choice (1 or 0; jvllm's name first), else `default`."""
    choice = multiprocessing_choice()
    return default if choice is None else choice


# Models whose requests carry images: the engine-core messages carry token ids only, so
# these are served by the in-process engine.
MULTIMODAL_ARCHITECTURES = frozenset(
    {"LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
)


def takes_images(model: str | os.PathLike[str] | None) -> bool:
    """Whether the checkpoint at `model` is a vision-language model (its config.json)."""
    if model is None:
        return False
    path = os.path.join(os.fspath(model), "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        architectures = json.load(f).get("architectures") or []
    return any(name in MULTIMODAL_ARCHITECTURES for name in architectures)

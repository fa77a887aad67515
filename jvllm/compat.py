"""vLLM arguments that mean nothing under JAX, and the values of them jvllm refuses.

Owns one table, shared by `jvllm serve` flags and `LLM(...)` keywords, so a vLLM
user's launch line and script carry over: each entry names a vLLM argument, its
command-line type, its `--help` group and why it has no effect here. `accept()` logs
one line per no-op given, raises ValueError for a value that would change
behaviour jvllm cannot honour, and maps vLLM's dtype aliases (`half`, `float`).
Arguments jvllm implements are EngineArgs fields or server flags, not entries here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("jvllm")


@dataclass(frozen=True)
class NoOp:
    name: str  # vLLM's keyword; the flag is its kebab-case form
    type: type
    group: str  # the `jvllm serve --help` group, as vLLM's
    reason: str
    nargs: str | None = None
    accepted: tuple[str, ...] | None = None  # the values that are no-ops; None: any
    offline_only: bool = False  # an LLM keyword; `jvllm serve` implements the flag itself


NO_OPS = (
    NoOp(
        "enforce_eager",
        bool,
        "ModelConfig",
        "JAX always runs compiled XLA programs; there are no CUDA graphs to turn off",
    ),
    NoOp(
        "trust_remote_code",
        bool,
        "ModelConfig",
        "jvllm runs its own Flax code for the architectures it supports, never a "
        "checkpoint's Python",
    ),
    NoOp(
        "load_format",
        str,
        "LoadConfig",
        "jvllm reads safetensors (and `jvllm convert` outputs) whichever you name",
        accepted=("auto", "safetensors"),
    ),
    NoOp(
        "download_dir",
        str,
        "LoadConfig",
        "jvllm loads local checkpoint directories; it downloads nothing",
    ),
    NoOp(
        "enable_chunked_prefill",
        bool,
        "SchedulerConfig",
        "chunked prefill is always on: one token budget covers prefill and decode",
    ),
    NoOp(
        "compilation_config",
        str,
        "CompilationConfig",
        "torch.compile and CUDA-graph options; XLA compiles each bucketed step once",
    ),
    NoOp(
        "cuda_graph_sizes",
        int,
        "CompilationConfig",
        "XLA compiles one program per batch bucket; there are no CUDA graphs",
        nargs="+",
    ),
    NoOp(
        "max_seq_len_to_capture",
        int,
        "CompilationConfig",
        "there are no CUDA graphs to capture",
    ),
    NoOp(
        "disable_custom_all_reduce",
        bool,
        "ParallelConfig",
        "collectives are XLA's; there is no custom all-reduce kernel",
    ),
    NoOp(
        "disable_log_stats",
        bool,
        "ModelConfig",
        "the offline API shows a progress bar, not periodic stats lines",
        offline_only=True,
    ),
)
_BY_NAME = {n.name: n for n in NO_OPS}
# vLLM's other names for dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def no_ops(offline: bool) -> list[NoOp]:
    """The table's entries for LLM(...) (offline) or for `jvllm serve`; an EngineArgs
    field of the same name (implemented since) takes the entry's place."""
    from jvllm.engine_args import EngineArgs

    implemented = set(EngineArgs.field_names())
    return [n for n in NO_OPS if (offline or not n.offline_only) and n.name not in implemented]


def accept(model: str, options: Mapping[str, Any], offline: bool = False) -> dict[str, Any]:
    """`options` less the no-ops among them, each logged once; a refused value raises."""
    known = {n.name for n in no_ops(offline)}
    for name in sorted(known & set(options)):
        _check(_BY_NAME[name], options[name], model)
        logger.info("%s=%r has no effect in jvllm: %s", name, options[name], _BY_NAME[name].reason)
    kept = {k: v for k, v in options.items() if k not in known}
    if kept.get("dtype") in DTYPE_ALIASES:
        kept["dtype"] = DTYPE_ALIASES[kept["dtype"]]
    return kept


def _check(entry: NoOp, value: Any, model: str) -> None:
    if entry.accepted is not None and value not in entry.accepted:
        raise ValueError(
            f"{entry.name}={value!r} is not supported: {entry.reason}; "
            f"accepted: {', '.join(entry.accepted)}"
        )
    if entry.name == "trust_remote_code" and value:
        _check_remote_code(model)


def _check_remote_code(model: str) -> None:
    """trust_remote_code asks for the checkpoint's own modelling code: fine (a no-op) when
    jvllm has the architecture, refused when it does not."""
    from jvllm.models.loader import read_config
    from jvllm.models.registry import supported_architectures

    architectures = read_config(model).get("architectures") or []
    unknown = [a for a in architectures if a not in supported_architectures()]
    if unknown or not architectures:
        raise ValueError(
            f"trust_remote_code=True: {model} declares architectures {architectures}, and "
            "jvllm cannot run a checkpoint's own Python code; supported: "
            f"{', '.join(supported_architectures())}"
        )

"""Building a pooling engine from `EngineArgs` (`EngineArgs.create_engine` calls it).

Owns the choices only a pooling model needs: whether the arguments name one
(`pooling_task`), its runner class, its `PoolingModelConfig`, and turning prefix caching
off where the pooler reads every token's row (MEAN, CLS: a cached prefix is not
recomputed, so its rows would be missing). Loading, sizing the KV cache and warming up
are `EngineArgs._build`'s, shared with generation.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from jvllm.engine.pooling_engine import PoolingEngine
from jvllm.models.loader import read_config
from jvllm.pooling.config import pooling_model_config, resolve_runner
from jvllm.runner.model_runner import ModelRunner
from jvllm.runner.pooling_runner import PoolingRunner
from jvllm.tokenizer_loading import load_tokenizer

__all__ = ["PoolingEngine", "create_pooling_engine", "pooling_task", "runner_class"]
logger = logging.getLogger("jvllm")


def _task(model: str, runner: str, convert: str) -> str | None:
    try:
        hf_config = read_config(model)
    except (OSError, ValueError):
        if runner == "auto" and convert == "auto":
            return None  # not a checkpoint we can read: generation's loader says why
        raise
    return resolve_runner(runner, convert, hf_config)


def pooling_task(args: Any) -> str | None:
    """ "embed" or "classify" for a pooling model, None for a generating one."""
    return _task(args.model, args.runner, args.convert)


def runner_class(args: Any) -> type[ModelRunner]:
    return PoolingRunner if pooling_task(args) is not None else ModelRunner


def create_pooling_engine(args: Any) -> PoolingEngine:
    """The pooling engine of `args` (an `EngineArgs` naming a pooling model)."""
    task = pooling_task(args)
    assert task is not None
    hf_config = read_config(args.model)
    pooling = pooling_model_config(task, Path(args.model), hf_config, args.pooler_config)
    if pooling.pooler.pooling_type != "LAST" and args.enable_prefix_caching:
        logger.info(
            "pooling_type=%s reads every prompt token: prefix caching is off",
            pooling.pooler.pooling_type,
        )
        args = dataclasses.replace(args, enable_prefix_caching=False)
    built = args._build()
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    spec = built.loaded.spec
    logger.info(
        "Pooling model: task %s, pooling %s, activation %s",
        task,
        pooling.pooler.pooling_type,
        pooling.pooler.activation,
    )
    return PoolingEngine(
        built.config,
        pooling,
        tokenizer,
        built.runner,
        built.runner.num_blocks,
        spec.vocab_size,
        built.num_host_blocks,
    )

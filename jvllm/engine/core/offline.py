"""The offline `LLM`'s engine: in this process by default, or in an engine-core process
with `JVLLM_ENABLE_V1_MULTIPROCESSING=1` (vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING`).

Owns `create_offline_engine`; imports nothing of the split until it is asked for one
(`multiproc_engine.py`). Not owned: `LLM` itself.
"""

from __future__ import annotations

import logging
from typing import Any

from jvllm.engine.core.env import MULTIPROCESSING_ENV, multiprocessing_enabled, takes_images

logger = logging.getLogger("jvllm.engine_core")


def create_offline_engine(engine_args: Any) -> Any:
    """`engine_args.create_engine()`, or with the environment's multiprocessing flag an
    engine core in a process of its own (not for pooling models, nor for `devices=`:
    devices cannot be handed to another process)."""
    from jvllm.engine_args import pooling_task

    if not multiprocessing_enabled(default=False):
        return engine_args.create_engine()
    if pooling_task(engine_args) is not None:
        logger.warning("pooling models run in-process: ignoring JVLLM_ENABLE_V1_MULTIPROCESSING")
        return engine_args.create_engine()
    if takes_images(engine_args.model):
        logger.warning("vision-language models run in-process: ignoring %s", MULTIPROCESSING_ENV[0])
        return engine_args.create_engine()
    if getattr(engine_args, "devices", None) is not None:
        raise ValueError(
            "devices= (or mesh=) cannot be used with JVLLM_ENABLE_V1_MULTIPROCESSING=1: the "
            "engine core runs in another process; unset one of them"
        )
    from jvllm.engine.core.multiproc_engine import MultiprocEngine

    return MultiprocEngine(engine_args)

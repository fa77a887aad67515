"""The `jvllm` command line: `jvllm serve [MODEL] [flags]`, `jvllm convert MODEL OUT`.

Owns argument parsing. Engine flags are derived from the `EngineArgs` dataclass
(one `--kebab-case` flag per field, typed from its annotation), so a new engine
knob is a new flag without touching this file; only flags given on the command
line reach EngineArgs, so its defaults stay the single source of truth. Serving
the process is `jvllm.server.launch`'s job.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from jvllm.config import ATTENTION_BACKENDS, DTYPES, SCHEDULING_POLICIES

logger = logging.getLogger("jvllm")
_LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"

_CHOICES = {
    "dtype": DTYPES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "attention_backend": ATTENTION_BACKENDS,
}
_HELP = {
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "weight and activation dtype; auto keeps the checkpoint's",
    "seed": "engine seed for requests that set none",
    "block_size": "tokens per KV-cache block",
    "max_model_len": "longest sequence, prompt plus output (default: the model's)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prefill and decode together)",
    "gpu_memory_utilization": "fraction of device memory for weights and KV cache",
    "num_gpu_blocks_override": "KV-cache blocks to allocate, instead of sizing from memory",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "tensor_parallel_size": "devices to shard the model over",
    "scheduling_policy": "continuous batching, or static batches (for comparison)",
    "async_scheduling": "schedule the next step while the device runs this one",
    "attention_backend": "attention implementation",
    "cpu_kv_cache_bytes": "KV-cache budget on a CPU backend",
    "compilation_cache_dir": "JAX persistent compilation cache ('' turns it off; "
    "default $JVLLM_CACHE/xla)",
}


def engine_flag_fields() -> list[tuple[str, Any]]:
    """(field name, resolved type) of every EngineArgs field but `model`."""
    from jvllm.engine_args import EngineArgs

    hints = typing.get_type_hints(EngineArgs)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(EngineArgs) if f.name != "model"]


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineArgs)")
    for name, hint in engine_flag_fields():
        flag = "--" + name.replace("_", "-")
        base = _base_type(hint)
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        kwargs["help"] = _HELP.get(name, f"EngineArgs.{name}")
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = base
            kwargs["metavar"] = base.__name__.upper()
            if name in _CHOICES:
                kwargs["choices"] = _CHOICES[name]
                kwargs.pop("metavar")
        group.add_argument(flag, **kwargs)


def _base_type(hint: Any) -> type:
    """`int | None` -> int; a plain type stays itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(members) == 1, f"unsupported EngineArgs annotation {hint}"
        return members[0]
    return hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jvllm", description="JAX LLM inference and serving")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face checkpoint directory) over an "
        "OpenAI-compatible API. Without MODEL, serve a tiny random-weight demo model.",
    )
    serve.add_argument("model", nargs="?", help="checkpoint directory (default: the demo model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("JVLLM_API_KEY"),
        help="require `Authorization: Bearer KEY` on inference routes (env: JVLLM_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: MODEL as given)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests that may wait for a slot before new ones get 503 (default: %(default)s)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: %(default)s)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="largest accepted request body; larger ones get 413 (default: 4 MiB)",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    serve.add_argument(
        "--disable-access-log", action="store_true", help="do not log each HTTP request"
    )
    _add_engine_flags(serve)
    convert = commands.add_parser(
        "convert",
        help="save a checkpoint's loaded parameters as an orbax checkpoint",
        description="Load MODEL (a Hugging Face checkpoint directory) once and save it to OUT "
        "as an orbax checkpoint that LLM(model=OUT) and `jvllm serve OUT` restore sharded.",
    )
    convert.add_argument("model", help="Hugging Face checkpoint directory")
    convert.add_argument("out", help="output directory (must be empty or absent)")
    convert.add_argument("--tensor-parallel-size", type=int, default=1)
    convert.add_argument("--dtype", choices=DTYPES, default="auto")
    return parser


def _convert(args: argparse.Namespace) -> int:
    from jvllm.convert import convert

    seconds = convert(args.model, args.out, args.tensor_parallel_size, args.dtype)
    logger.info("converted %s -> %s in %.1f s", args.model, args.out, seconds)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from jvllm.engine_args import EngineArgs
    from jvllm.server.launch import ServerConfig, run_server

    engine_kwargs = {name: getattr(args, name) for name, _ in engine_flag_fields() if name in args}
    if engine_kwargs.get("coordinator_address") or engine_kwargs.get("num_processes"):
        raise ValueError("the server runs on one host; multi-host runs the offline LLM API")
    is_demo = args.model is None
    if is_demo:
        from jvllm.testing.demo import DEMO_ENGINE_DEFAULTS, DEMO_NAME, ensure_demo_model

        model = str(ensure_demo_model())
        engine_kwargs = {**DEMO_ENGINE_DEFAULTS, **engine_kwargs}
        names = tuple(args.served_model_name or [DEMO_NAME])
        logger.warning(
            "no MODEL given: serving the built-in DEMO model (tiny, random weights, its "
            "output is noise) from %s; pass a checkpoint directory to serve a real model",
            model,
        )
    else:
        model = args.model
        names = tuple(args.served_model_name or [model])
    config_kwargs: dict[str, Any] = {}
    if args.max_request_body_bytes is not None:
        config_kwargs["max_request_body_bytes"] = args.max_request_body_bytes
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_names=names,
        max_queued_requests=args.max_queued_requests,
        shutdown_timeout=args.shutdown_timeout,
        uvicorn_log_level=args.uvicorn_log_level,
        disable_access_log=args.disable_access_log,
        **config_kwargs,
    )
    return run_server(EngineArgs(model=model, **engine_kwargs), config, model, is_demo)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    if args.command == "convert":
        try:
            return _convert(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"jvllm convert: error: {e}", file=sys.stderr)
            return 2
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"jvllm serve needs: pip install 'jvllm[serve]' ({e})", file=sys.stderr)
        return 2
    try:
        return _serve(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        # A bad flag or checkpoint: say what is wrong, without a traceback.
        print(f"jvllm serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

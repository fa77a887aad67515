"""The `jvllm` command line: `jvllm serve [MODEL] [flags]`, `jvllm convert MODEL OUT`,
`jvllm compare MODEL` (`jvllm.testing.compare_cli`).

Owns argument parsing, with vLLM's spellings: engine flags are derived from the
`EngineArgs` dataclass (one `--kebab-case` flag per field, typed from its annotation,
booleans with a `--no-` form), grouped in `--help` as vLLM groups them, so a new
engine knob is a new flag without touching this file; only flags given on the
command line reach EngineArgs, so its defaults stay the single source of truth.
vLLM flags without effect here come from `jvllm.compat`, the server's own from
`jvllm.server.cli_args`, and `--config FILE.yaml` from `jvllm.yaml_args`. Serving
the process is `jvllm.server.launch`'s job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from jvllm import compat
from jvllm.config import ATTENTION_BACKENDS, DTYPES, PREEMPTION_MODES, SCHEDULING_POLICIES
from jvllm.server.cli_args import add_frontend_flags, server_config
from jvllm.testing.compare_cli import add_compare_parser, run_compare
from jvllm.yaml_args import config_file_argv

logger = logging.getLogger("jvllm")
_LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"

_CHOICES = {
    "dtype": (*DTYPES, *compat.DTYPE_ALIASES),
    "scheduling_policy": SCHEDULING_POLICIES,
    "preemption_mode": PREEMPTION_MODES,
    "attention_backend": ATTENTION_BACKENDS,
}
_HELP = {
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "weight and activation dtype; auto keeps the checkpoint's",
    "quantization": "quantize the linear weights at load, per output channel: int8 or fp8 "
    "(float8 e4m3); embeddings, lm_head and norms keep the dtype",
    "seed": "engine seed for requests that set none",
    "block_size": "tokens per KV-cache block",
    "max_model_len": "longest sequence, prompt plus output (default: the model's)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prefill and decode together)",
    "gpu_memory_utilization": "fraction of device memory for weights and KV cache",
    "num_gpu_blocks_override": "KV-cache blocks to allocate, instead of sizing from memory",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "tensor_parallel_size": "devices to shard each layer over",
    "enable_expert_parallel": "mixture-of-experts models: split the experts whole over the "
    "tensor-parallel devices (attention stays tensor parallel)",
    "coordinator_address": "multi-host: host:port of process 0's jax.distributed coordinator "
    "(or JVLLM_COORDINATOR_ADDRESS)",
    "num_processes": "multi-host: processes in all (or JVLLM_NUM_PROCESSES)",
    "process_id": "multi-host: this process's rank; 0 serves HTTP, the others follow its "
    "steps (or JVLLM_PROCESS_ID)",
    "pipeline_parallel_size": "pipeline stages to split the layers into (each stage on "
    "tensor_parallel_size devices)",
    "pipeline_micro_batches": "micro-batches a step runs through the pipeline stages "
    "(default: one per stage; 1 runs one batch through the stages at a time)",
    "scheduling_policy": "continuous batching first come first served (fcfs is the same), "
    "by each request's priority (lower first, ties by arrival), or static batches "
    "(for comparison)",
    "async_scheduling": "schedule the next step while the device runs this one",
    "preemption_mode": "what preemption does to a request's KV blocks: recompute them "
    "later, or swap them to host memory and back",
    "swap_space": "GiB of host memory per device for swapped-out KV blocks "
    "(with --preemption-mode swap)",
    "kv_offloading_size": "GiB of host memory per device for prefix-cache blocks evicted "
    "from the device (0: off)",
    "kv_transfer_config": 'the fs KV tier below the host tier, vLLM\'s JSON: {"kv_connector": '
    '"OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": '
    '"TieringOffloadingSpec", "cpu_bytes_to_use": N, "secondary_tiers": [{"type": "fs", '
    '"root_dir": DIR}]}} (docs/kv_tiers.md)',
    "kv_offload_dir": "directory of the fs KV tier below the host tier (needs "
    "--kv-offloading-size); blocks there survive restarts",
    "kv_offload_dir_size": "GiB the fs KV tier's directory may hold (LRU eviction)",
    "cpu_offload_gb": "GiB of weights per device kept in pinned host memory (whole decoder "
    "layers from the first; each step copies them in)",
    "kv_cache_dtype": "KV-cache storage: auto (the model dtype), fp8 / fp8_e4m3 or fp8_e5m2 "
    "(one byte a value: twice the blocks of bfloat16)",
    "attention_backend": "attention implementation",
    "cpu_kv_cache_bytes": "KV-cache budget on a CPU backend",
    "compilation_cache_dir": "compiled programs kept between starts ('' turns it off; "
    "default $JVLLM_CACHE/xla)",
    "generation_config": "auto (the model's generation_config.json supplies request defaults), "
    "vllm (ignore its sampling defaults) or a directory holding one",
    "max_logprobs": "most logprobs and prompt_logprobs a request may ask for",
    "speculative_config": 'speculative decoding, a JSON object: {"method": "ngram", '
    '"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    "speculative_model": "the older spelling: [ngram]",
    "num_speculative_tokens": "draft tokens per step (with --speculative-model)",
    "ngram_prompt_lookup_max": "longest suffix n-gram to look up (with --speculative-model)",
    "ngram_prompt_lookup_min": "shortest suffix n-gram to look up (with --speculative-model)",
    "enable_lora": "serve PEFT LoRA adapters, chosen per request (docs/lora.md)",
    "max_loras": "adapters resident on the devices at once: the most one batch mixes",
    "max_lora_rank": "the largest adapter rank accepted (every device slot's rank)",
    "max_cpu_loras": "adapters kept read in host memory (default: --max-loras)",
    "lora_dtype": "the adapters' dtype on the devices: auto (the model's), float32, "
    "bfloat16, float16",
    "runner": "auto | generate | pooling (embeddings, classification, scores: docs/pooling.md)",
    "convert": "auto | embed | classify: the pooling task of a --runner pooling model",
    "pooler_config": 'a JSON object: {"pooling_type": "LAST" | "MEAN" | "CLS", '
    '"use_activation": true, "dimensions": null}',
}


# The `jvllm serve --help` group of each EngineArgs field, as vLLM groups its flags.
_GROUPS = {
    "tokenizer": "ModelConfig",
    "dtype": "ModelConfig",
    "quantization": "ModelConfig",
    "seed": "ModelConfig",
    "max_model_len": "ModelConfig",
    "attention_backend": "ModelConfig",
    "generation_config": "ModelConfig",
    "max_logprobs": "ModelConfig",
    **dict.fromkeys(("runner", "convert", "pooler_config"), "ModelConfig"),
    "block_size": "CacheConfig",
    "gpu_memory_utilization": "CacheConfig",
    "num_gpu_blocks_override": "CacheConfig",
    "enable_prefix_caching": "CacheConfig",
    "cpu_kv_cache_bytes": "CacheConfig",
    "max_num_seqs": "SchedulerConfig",
    "max_num_batched_tokens": "SchedulerConfig",
    "scheduling_policy": "SchedulerConfig",
    "async_scheduling": "SchedulerConfig",
    "preemption_mode": "SchedulerConfig",
    "swap_space": "CacheConfig",
    "kv_offloading_size": "CacheConfig",
    **dict.fromkeys(
        ("kv_transfer_config", "kv_offload_dir", "kv_offload_dir_size"), "KVTransferConfig"
    ),
    "cpu_offload_gb": "CacheConfig",
    "kv_cache_dtype": "CacheConfig",
    "tensor_parallel_size": "ParallelConfig",
    "enable_expert_parallel": "ParallelConfig",
    "pipeline_parallel_size": "ParallelConfig",
    "pipeline_micro_batches": "ParallelConfig",
    "coordinator_address": "ParallelConfig",
    "num_processes": "ParallelConfig",
    "process_id": "ParallelConfig",
    "compilation_cache_dir": "CompilationConfig",
    "speculative_config": "SpeculativeConfig",
    "speculative_model": "SpeculativeConfig",
    "num_speculative_tokens": "SpeculativeConfig",
    "ngram_prompt_lookup_max": "SpeculativeConfig",
    "ngram_prompt_lookup_min": "SpeculativeConfig",
    "enable_lora": "LoRAConfig",
    "max_loras": "LoRAConfig",
    "max_lora_rank": "LoRAConfig",
    "max_cpu_loras": "LoRAConfig",
    "lora_dtype": "LoRAConfig",
}
_GROUP_ORDER = (
    "ModelConfig",
    "LoadConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "CompilationConfig",
    "SpeculativeConfig",
    "LoRAConfig",
    "KVTransferConfig",
    "EngineArgs",  # fields not in _GROUPS yet
)
_ALIASES = {
    "tensor_parallel_size": ["-tp"],
    "pipeline_parallel_size": ["-pp"],
    "compilation_config": ["-O"],
}


def engine_flag_fields() -> list[tuple[str, Any]]:
    """(field name, resolved type) of every EngineArgs field but `model` and the
    offline-only ones (`devices`)."""
    from jvllm.engine_args import EngineArgs

    hints = typing.get_type_hints(EngineArgs)
    return [
        (f.name, hints[f.name])
        for f in dataclasses.fields(EngineArgs)
        if f.name != "model" and f.metadata.get("flag", True)
    ]


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    groups = {title: parser.add_argument_group(title) for title in _GROUP_ORDER}
    model = groups["ModelConfig"]
    model.add_argument(
        "--model", dest="model_option", metavar="MODEL", help="checkpoint directory, as MODEL"
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: MODEL as given)",
    )
    for name, hint in engine_flag_fields():
        group = groups[_GROUPS.get(name, "EngineArgs")]
        _add_flag(group, name, _base_type(hint), _HELP.get(name, f"EngineArgs.{name}"))
    for entry in compat.no_ops(offline=False):
        help = f"accepted, no effect: {entry.reason}"
        _add_flag(groups[entry.group], entry.name, entry.type, help, entry.nargs)


def _add_flag(
    group: argparse._ArgumentGroup, name: str, base: type, help: str, nargs: str | None = None
) -> None:
    flags = ["--" + name.replace("_", "-"), *_ALIASES.get(name, [])]
    # Only flags given on the command line reach EngineArgs, whose defaults stay the truth.
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=base, metavar=base.__name__.upper(), nargs=nargs)
        if name in _CHOICES:
            kwargs["choices"] = _CHOICES[name]
            kwargs.pop("metavar")
    group.add_argument(*flags, **kwargs)


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; a dict is parsed from JSON; a plain type stays itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(members) == 1, f"unsupported EngineArgs annotation {hint}"
        return _base_type(members[0])
    if typing.get_origin(hint) is dict:
        return json_object
    return hint


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value (argparse reports the ValueError as a bad value)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def build_serve_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jvllm serve",
        add_help=add_help,
        description="Serve MODEL (a Hugging Face checkpoint directory) over an "
        "OpenAI-compatible API. Without MODEL, serve the small demo model built into jvllm. "
        "Flags are vLLM's; those that mean nothing under JAX are accepted and logged.",
    )
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the demo model)")
    parser.add_argument(
        "--config",
        help="a YAML file of flags (keys are flag names); the command line wins over it",
    )
    add_frontend_flags(parser)
    _add_engine_flags(parser)
    return parser


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """`jvllm serve` arguments; with --config, the file's flags under the command line's."""
    parser = build_serve_parser()
    args = parser.parse_args(argv)
    if args.config is None:
        return args
    from_file = parser.parse_args(config_file_argv(args.config))
    # Parsing into the file's namespace keeps its values unless a flag here overrides them.
    return parser.parse_args(argv, namespace=from_file)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jvllm", description="JAX LLM inference and serving")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "serve",
        parents=[build_serve_parser(add_help=False)],
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible API (see `jvllm serve --help`).",
    )
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
    add_compare_parser(commands)
    return parser


def _convert(args: argparse.Namespace) -> int:
    from jvllm.convert import convert

    seconds = convert(args.model, args.out, args.tensor_parallel_size, args.dtype)
    logger.info("converted %s -> %s in %.1f s", args.model, args.out, seconds)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from jvllm.engine_args import EngineArgs
    from jvllm.parallel.distributed import distributed_config
    from jvllm.runner.xla_allocator import configure_allocator
    from jvllm.server.launch import run_follower, run_server
    from jvllm.server.process_args import process_config

    names = [name for name, _ in engine_flag_fields()] + [n.name for n in compat.no_ops(False)]
    options = {name: getattr(args, name) for name in names if name in args}
    model = args.model or args.model_option
    is_demo = model is None
    if is_demo:
        from jvllm.demo import DEMO_ENGINE_DEFAULTS, DEMO_NAME, demo_description, demo_model_path

        model = str(demo_model_path())
        options = {**DEMO_ENGINE_DEFAULTS, **options}
        served = tuple(args.served_model_name or [DEMO_NAME])
        logger.warning(
            "no MODEL given: serving the built-in DEMO model from %s (%s); pass a checkpoint "
            "directory to serve a real model",
            model,
            demo_description(),
        )
    else:
        served = tuple(args.served_model_name or [model])
    engine_kwargs = compat.accept(model, options)
    engine_args = EngineArgs(model=model, **engine_kwargs)
    # Before JAX's backend starts (the server's engine, or a follower's runner).
    configure_allocator(engine_args.gpu_memory_utilization)
    dist = distributed_config(
        engine_args.coordinator_address, engine_args.num_processes, engine_args.process_id
    )
    if dist is not None and dist.process_id != 0:
        return run_follower(engine_args)  # serves nothing: process 0 answers HTTP
    config = server_config(args, served)
    return run_server(engine_args, config, model, is_demo, process_config(args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    if argv[:1] != ["serve"]:
        args = build_parser().parse_args(argv)
        try:
            return run_compare(args) if args.command == "compare" else _convert(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"jvllm {args.command}: error: {e}", file=sys.stderr)
            return 2
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"jvllm serve needs: pip install 'jvllm[serve]' ({e})", file=sys.stderr)
        return 2
    try:
        return _serve(parse_serve_args(argv[1:]))
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        # A bad flag, config file or checkpoint: say what is wrong, without a traceback.
        print(f"jvllm serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

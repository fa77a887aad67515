"""The LoRA flags of `jvllm serve` (`--lora-modules`, vLLM's two spellings, and
`--allow-runtime-lora-updating`) and their parsing. Imports nothing heavy, as
`cli_args.py`; what the flags do is `lora.py`'s.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import NamedTuple

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoRAModulePath(NamedTuple):
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name":
    ...}` (argparse's type for `--lora-modules`)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(
                f"--lora-modules {text!r}: invalid JSON ({e})"
            ) from None
        if not isinstance(entry, dict) or not {"name", "path"} <= set(entry):
            raise argparse.ArgumentTypeError(
                f"--lora-modules {text!r}: a JSON entry needs 'name' and 'path'"
            )
        return LoRAModulePath(str(entry["name"]), str(entry["path"]), entry.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path or JSON")
    return LoRAModulePath(name, path)


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA", "adapters served by name (with --enable-lora)")
    group.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        default=None,
        help='adapters to serve: name=path, or {"name": ..., "path": ..., "base_model_name": ...}',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (env: "
        f"{RUNTIME_UPDATING_ENV}=true)",
    )


def runtime_updating_allowed(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")

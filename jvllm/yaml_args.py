"""`jvllm serve --config FILE.yaml`: a YAML mapping of flag names to values, as vLLM's.

Owns turning the file into command-line arguments, so that the file's values go
through the same parsing and checks as typed flags: `key: value` becomes
`--key value`, `true`/`false` become `--key`/`--no-key`, a list becomes the flag
followed by its items, a mapping becomes JSON. Keys may use dashes or underscores.
Which flags exist, and that the command line wins over the file, is `jvllm.cli`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def config_file_argv(path: str) -> list[str]:
    """The flags a YAML config file stands for; raises for a missing or malformed file."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config needs PyYAML: pip install 'jvllm[serve]'") from None
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path}: invalid YAML ({e})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of flag names to values")
    argv: list[str] = []
    for key, value in data.items():
        argv += _flag_args(str(key), value, path)
    return argv


def _flag_args(key: str, value: Any, path: str) -> list[str]:
    name = key.replace("_", "-").lstrip("-")
    if name == "config":
        raise ValueError(f"config file {path}: a config file cannot name another one")
    if isinstance(value, bool):
        return [f"--{name}" if value else f"--no-{name}"]
    if value is None:
        return []
    if isinstance(value, list):
        return [f"--{name}", *(_scalar(v) for v in value)]
    return [f"--{name}", _scalar(value)]


def _scalar(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)

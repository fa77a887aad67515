"""Which runner a model gets and how its pooler reduces a prompt (vLLM's `runner`,
`convert` and `PoolerConfig`).

Owns resolving `runner="auto"|"generate"|"pooling"` and `convert="auto"|"embed"|"classify"`
for a checkpoint, and the `PoolerConfig`: the user's dict first, then a
sentence-transformers layout in the checkpoint (`modules.json`, its Pooling module's
`config.json`, a Normalize module), then the defaults (last-token pooling, activation on).
Host only: reads JSON files, imports neither jax nor the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config flag -> vLLM's pooling type.
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one output row.

    `pooling_type`: the last token's row (LAST, decoder embedders and classifiers), the
    mean over the prompt (MEAN) or the first token's (CLS). `use_activation`: embeddings
    L2-normalised, class logits through softmax (sigmoid for one label); None: on.
    `dimensions`: a default Matryoshka truncation of embeddings."""

    pooling_type: str = "LAST"
    use_activation: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {POOLING_TYPES}, "
                f"got {self.pooling_type!r}"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooler_config.dimensions must be >= 1, got {self.dimensions}")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> PoolerConfig:
        """vLLM's spelling; `seq_pooling_type` is `pooling_type`'s other name."""
        value = dict(value)
        if "seq_pooling_type" in value:
            if "pooling_type" in value:
                raise ValueError("give pooling_type or seq_pooling_type, not both")
            value["pooling_type"] = value.pop("seq_pooling_type")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config has unknown keys {unknown}; accepted: {sorted(known)}")
        return cls(**value)

    @property
    def activation(self) -> bool:
        return self.use_activation is None or self.use_activation


@dataclass(frozen=True)
class PoolingModelConfig:
    """A pooling model's resolved task and pooler."""

    convert: str  # "embed" or "classify"
    pooler: PoolerConfig
    num_labels: int  # classify: the score head's rows; embed: 0
    hidden_size: int
    # Matryoshka sizes the checkpoint names (None: any dimensions <= hidden_size works
    # only when the config says `is_matryoshka`; otherwise dimensions are refused).
    matryoshka_dimensions: tuple[int, ...] | None
    is_matryoshka: bool
    problem_type: str | None  # config.json's: "multi_label_classification" -> sigmoid

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if self.convert == "embed":
            return ("encode", "embed")
        return ("encode", "classify", "score")


def resolve_runner(runner: str, convert: str, hf_config: dict[str, Any]) -> str | None:
    """The pooling task ("embed" or "classify") the model serves, or None to generate."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    archs = hf_config.get("architectures") or [""]
    classifier = archs[0].endswith("ForSequenceClassification")
    if runner == "auto":
        runner = "pooling" if classifier or convert in ("embed", "classify") else "generate"
    if runner == "generate":
        if classifier or convert in ("embed", "classify"):
            raise ValueError(
                f"runner='generate' cannot serve {archs[0]} with convert={convert!r}; "
                "use runner='pooling'"
            )
        return None
    if convert in ("auto", "none"):
        return "classify" if classifier else "embed"
    if convert == "embed" and classifier:
        raise ValueError(f"{archs[0]} is a classifier: use convert='classify', not 'embed'")
    if convert == "classify" and not classifier:
        raise ValueError(
            f"convert='classify' needs a *ForSequenceClassification checkpoint (its score "
            f"head); {archs[0]} has none: use convert='embed'"
        )
    return convert


def pooler_from_sentence_transformers(model_dir: Path) -> dict[str, Any]:
    """The pooler settings a sentence-transformers layout names ({} without one)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    found: dict[str, Any] = {}
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            config = json.loads((model_dir / module["path"] / "config.json").read_text())
            modes = [t for key, t in _ST_MODES.items() if config.get(key)]
            if len(modes) != 1:
                raise ValueError(
                    f"{model_dir / module['path']}/config.json: exactly one of "
                    f"{sorted(_ST_MODES)} must be true (jvllm pools one way), got {modes}"
                )
            found["pooling_type"] = modes[0]
        elif kind.endswith(".Normalize"):
            found["use_activation"] = True
    found.setdefault("use_activation", False)
    return found


def pooling_model_config(
    convert: str, model_dir: Path, hf_config: dict[str, Any], user: dict[str, Any] | None
) -> PoolingModelConfig:
    """The pooler: `user`'s keys over the checkpoint's sentence-transformers layout."""
    settings = {**pooler_from_sentence_transformers(model_dir), **(user or {})}
    pooler = PoolerConfig.from_dict(settings)
    num_labels = 0
    if convert == "classify":
        num_labels = int(hf_config.get("num_labels") or len(hf_config.get("id2label") or {}) or 2)
    dims = hf_config.get("matryoshka_dimensions")
    return PoolingModelConfig(
        convert=convert,
        pooler=pooler,
        num_labels=num_labels,
        hidden_size=int(hf_config["hidden_size"]),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        is_matryoshka=bool(hf_config.get("is_matryoshka")) or bool(dims),
        problem_type=hf_config.get("problem_type"),
    )

"""Random-weight Hugging Face checkpoints and tokenizers, for tests and benchmarks alike.

Owns two ways to write one. `make_checkpoint` builds a tiny model of every supported
architecture through Transformers (torch, float32), for tests that compare against
the Transformers reference. `write_random_llama` writes a Llama checkpoint of any size
straight from numpy into safetensors in the target dtype (no torch, no float32 copy),
for the benchmarks' 8B-shaped models; `write_word_tokenizer` gives it a tokenizer whose
ids are words "w4 w5 ...". Imports nothing of jvllm: the benchmarks import this module.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # Larger than the usual 0.02 so logits are spread and greedy choices are clear-cut.
    initializer_range=0.1,
)
_PER_ARCH: dict[str, dict[str, Any]] = {
    # GQA with llama3 rope scaling.
    "llama": dict(
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        rope_theta=10000.0,
    ),
    # Sliding window shorter than the longest test prompt.
    "mistral": dict(sliding_window=64, rope_theta=10000.0),
    # q/k/v bias, tied embeddings.
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    # Per-head q/k RMSNorm, head_dim not hidden/heads.
    "qwen3": dict(head_dim=32, rope_theta=1000000.0),
}


def _config(arch: str, vocab_size: int, special_ids: dict[str, int], overrides: dict[str, Any]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }[arch]
    kwargs = {**_COMMON, **_PER_ARCH[arch], **special_ids, "vocab_size": vocab_size, **overrides}
    return cls(**kwargs)


def make_checkpoint(
    arch: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Builds a random-weight checkpoint of `arch` with the tokenizer copied beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    out = Path(out_dir)
    vocab_size, special = tokenizer_special_ids(tokenizer_dir)
    config = _config(arch, vocab_size, special, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(getattr(torch, dtype)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    copy_tokenizer(tokenizer_dir, out)
    return out


def tokenizer_special_ids(tokenizer_dir: str | Path) -> tuple[int, dict[str, int]]:
    """The tokenizer's vocabulary size and its BOS/EOS/PAD ids as config keywords."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    return len(tok), dict(zip(("bos_token_id", "eos_token_id", "pad_token_id"), ids, strict=True))


def copy_tokenizer(tokenizer_dir: str | Path, out: Path) -> None:
    """The tokenizer's files beside a checkpoint, as the Hub lays them out."""
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)


# -- any size, no torch ----------------------------------------------------------------

WORD_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")  # ids 0..3; words follow


def write_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer with exactly `vocab_size` ids: specials, then words w4, w5...

    Every id a random model samples decodes to text, and a prompt written as
    "w17 w230 ..." encodes to exactly those ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = WORD_SPECIAL_TOKENS
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = dict(zip(("bos_token", "eos_token", "pad_token", "unk_token"), specials, strict=True))
    PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(out_dir)


def llama_tensor_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hugging Face Llama tensor names and `[out, in]` shapes of a config.json, in order."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, config["num_key_value_heads"] * head_dim
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        yield layer + "input_layernorm.weight", (h,)
        yield layer + "self_attn.q_proj.weight", (q, h)
        yield layer + "self_attn.k_proj.weight", (kv, h)
        yield layer + "self_attn.v_proj.weight", (kv, h)
        yield layer + "self_attn.o_proj.weight", (h, q)
        yield layer + "post_attention_layernorm.weight", (h,)
        yield layer + "mlp.gate_proj.weight", (inter, h)
        yield layer + "mlp.up_proj.weight", (inter, h)
        yield layer + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not config.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h)


def write_random_llama(out_dir: Path, config: dict[str, Any], shard_bytes: int = 2 << 30) -> None:
    """config.json and safetensors shards of N(0, 0.02) weights (norms 1) in
    `config["dtype"]` ("float32" or "bfloat16").

    Each tensor tiles a shifted copy of one random pool of a prime length, so 8B
    parameters take seconds and never a float32 copy of the model.
    """
    import ml_dtypes

    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[config["dtype"]]
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1_000_003, np.float32) * 0.02).astype(dtype)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in llama_tensor_shapes(config):
        nbytes = int(np.prod(shape)) * pool.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    _save_shards(out_dir, shards, pool)


def _save_shards(
    out_dir: Path, shards: list[list[tuple[str, tuple[int, ...]]]], pool: np.ndarray
) -> None:
    from safetensors.numpy import save_file

    weight_map, total = {}, 0
    for index, shard in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for k, (name, shape) in enumerate(shard):
            if name.endswith("norm.weight"):
                tensors[name] = np.ones(shape, pool.dtype)
            else:
                tensors[name] = np.resize(np.roll(pool, 7919 * (index * 1000 + k)), shape)
            weight_map[name] = file
            total += tensors[name].nbytes
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))

"""Checkpoint loading: sharded files, dtypes, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.models.loader import load_model
from jvllm.testing import make_checkpoint


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads_same_params(checkpoints, tokenizer_dir, tmp_path):
    sharded = make_checkpoint("llama", tmp_path / "sharded", tokenizer_dir, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    one = load_model(checkpoints["llama"]).params
    many = load_model(sharded).params
    w1 = one["model"]["layers_1"]["mlp"]["down_proj"]["weight"]
    w2 = many["model"]["layers_1"]["mlp"]["down_proj"]["weight"]
    np.testing.assert_array_equal(np.asarray(w1), np.asarray(w2))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtype_conversion(checkpoints, dtype):
    loaded = load_model(checkpoints["qwen2"], dtype)
    assert loaded.dtype == jnp.dtype(dtype)
    emb = loaded.params["model"]["embed_tokens"]["embedding"]
    assert emb.dtype == jnp.dtype(dtype)
    assert "lm_head" not in loaded.params  # tied embeddings


def test_bf16_checkpoint_auto_dtype(tokenizer_dir, tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "bf16", tokenizer_dir, dtype="bfloat16")
    loaded = load_model(path)
    assert loaded.dtype == jnp.bfloat16


def test_unknown_dtype(checkpoints):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(checkpoints["llama"], "float8")


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "ck")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load_model(path)


def test_unsupported_rope_scaling(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "ck")
    edit_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        load_model(path)


def test_truncated_file(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["mistral"], tmp_path / "ck")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="model.safetensors: truncated"):
        load_model(path)


def test_missing_safetensors(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["mistral"], tmp_path / "ck")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(path)


def test_shape_mismatch_names_tensor(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "ck")
    edit_config(path, intermediate_size=96)
    with pytest.raises(
        ValueError, match=r"mlp\.[a-z]+_proj.weight' has shape .* expected .* from config.json"
    ):
        load_model(path)


def test_missing_tensor_names_it(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "ck")
    edit_config(path, num_hidden_layers=3)
    with pytest.raises(ValueError, match="no tensor 'model.layers.2"):
        load_model(path)


def test_unexpected_tensor_names_it(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["llama"], tmp_path / "ck")
    edit_config(path, num_hidden_layers=1)
    with pytest.raises(ValueError, match="does not use: \\['model.layers.1"):
        load_model(path)

"""LLM.update_weights against Transformers: a second random checkpoint swapped into a live
engine as a directory, as (name, array) pairs and as the engine's own tree gives
Transformers' greedy tokens on the new weights, with no recompilation and no stale
prefix-cache block; the same under tensor parallelism, from arrays on other devices."""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from safetensors.numpy import load_file

from jvllm import LLM, SamplingParams
from jvllm.testing import make_checkpoint
from tests.helpers import hf_greedy, prompts, token_prompts

NEW_TOKENS = 8
PROMPTS = prompts(seed=3, lengths=[5, 17, 40])
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory, tokenizer_dir) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("second"), tokenizer_dir, seed=1)


def greedy_reference(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    return [hf_greedy(model, p, NEW_TOKENS, eos) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(checkpoints, second_checkpoint) -> dict[str, list[list[int]]]:
    first, second = greedy_reference(checkpoints["llama"]), greedy_reference(second_checkpoint)
    assert first != second  # the two checkpoints tell their weights apart
    return {"first": first, "second": second}


def pairs_of(path: Path, to_jax: bool = False) -> list[tuple[str, object]]:
    """(Hugging Face name, array) of every tensor of a checkpoint, numpy or jax."""
    tensors = load_file(str(path / "model.safetensors"))
    return [(name, jnp.asarray(a) if to_jax else a) for name, a in tensors.items()]


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(str(checkpoints["llama"]), **ENGINE)


def test_update_from_directory_pairs_and_tree_matches_transformers(
    llm, references, checkpoints, second_checkpoint
):
    assert greedy(llm) == references["first"]  # every prompt's blocks now cached
    compiled = llm.get_metrics()["num_compilations"]
    hits = llm.get_metrics()["prefix_cache_hits"]

    llm.update_weights(str(second_checkpoint))
    assert greedy(llm) == references["second"]
    # The same prompts again found nothing cached: no block of the old weights survived.
    assert llm.get_metrics()["prefix_cache_hits"] == hits
    second_tree = jax.tree.map(lambda x: np.array(x), llm.get_weights())

    assert llm.update_weights(pairs_of(checkpoints["llama"])) > 0  # numpy pairs
    assert greedy(llm) == references["first"]
    llm.update_weights(pairs_of(second_checkpoint, to_jax=True))  # jax pairs
    assert greedy(llm) == references["second"]
    llm.update_weights(pairs_of(checkpoints["llama"]))
    llm.update_weights(second_tree)  # the engine's own layout
    assert greedy(llm) == references["second"]
    assert llm.get_metrics()["num_compilations"] == compiled


def test_weight_version_and_an_update_in_parts(llm, references, checkpoints):
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="finish_weight_update"):
        llm.generate("hi", use_tqdm=False)
    first = pairs_of(checkpoints["llama"])
    llm.update_weights(first[: len(first) // 2])
    llm.update_weights(first[len(first) // 2 :])
    llm.finish_weight_update(weight_version=7)
    assert llm.get_weight_version() == 7
    assert llm.get_metrics()["weight_version"] == 7
    assert greedy(llm) == references["first"]


def test_bad_weights_are_refused_by_name(llm, references, checkpoints):
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        llm.update_weights([("model.layers.9.mlp.up_proj.weight", np.zeros((2, 2)))])
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="has shape \\(2, 2\\)"):
        llm.update_weights([(name, np.zeros((2, 2), np.float32))])
    with pytest.raises(FileNotFoundError, match="not a directory"):
        llm.update_weights("/nonexistent/checkpoint")
    # A bad tensor after good ones: those before it are in, none is left freed.
    good = pairs_of(checkpoints["llama"])
    with pytest.raises(ValueError, match="no_such.weight"):
        llm.update_weights([*good[:3], ("model.no_such.weight", np.zeros(2))])
    assert greedy(llm) == references["first"]


def test_an_update_frees_each_old_tensor_as_it_goes(llm, checkpoints):
    def live_bytes() -> int:
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())

    gc.collect()  # what earlier tests left is gone before counting
    start = live_bytes()
    seen = []

    def streamed():  # numpy pairs, read one at a time: the device holds only the engine's
        for name, array in pairs_of(checkpoints["llama"]):
            seen.append(live_bytes())
            yield name, array

    llm.update_weights(streamed())
    assert max(seen) == start == live_bytes()  # no second copy builds up


def test_tensor_parallel_engine_on_the_callers_mesh_updated_from_other_devices(
    references, checkpoints, second_checkpoint
):
    devices = jax.devices()[2:4]
    # The trainer's state, already on the engine's devices.
    state = jax.device_put(np.ones((64, 64), np.float32), devices[0])
    llm = LLM(str(checkpoints["llama"]), mesh=Mesh(np.array(devices), ("data",)), **ENGINE)
    held = {d for leaf in jax.tree.leaves(llm.get_weights()) for d in leaf.sharding.device_set}
    assert held == set(devices)  # tensor_parallel_size=2 on the mesh's two devices
    assert greedy(llm) == references["first"]
    compiled = llm.get_metrics()["num_compilations"]
    elsewhere = jax.devices()[5]  # not one of the engine's devices
    pairs = [(n, jax.device_put(a, elsewhere)) for n, a in pairs_of(second_checkpoint)]
    llm.update_weights(pairs)
    assert greedy(llm) == references["second"]
    assert llm.get_metrics()["num_compilations"] == compiled
    assert float(state.sum()) == 64 * 64  # untouched


def test_engine_on_one_device_of_the_callers_list(references, checkpoints):
    device = jax.devices()[6]
    llm = LLM(str(checkpoints["llama"]), devices=[device], **ENGINE)
    leaves = jax.tree.leaves(llm.get_weights())
    assert {d for leaf in leaves for d in leaf.sharding.device_set} == {device}
    assert greedy(llm) == references["first"]
    with pytest.raises(ValueError, match="mesh= or devices="):
        LLM(str(checkpoints["llama"]), mesh=Mesh(np.array([device]), ("x",)), devices=[device])


def test_draft_model_update_changes_the_drafts_not_the_outputs(
    references, checkpoints, second_checkpoint
):
    path = str(checkpoints["llama"])
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    llm = LLM(path, speculative_config=spec, **ENGINE)

    def acceptance() -> float:
        before = llm.get_metrics()
        assert greedy(llm) == references["first"]  # speculation never changes outputs
        after = llm.get_metrics()
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = (
            after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        )
        return accepted / drafted

    assert acceptance() == 1.0  # the draft is the target
    llm.update_weights(str(second_checkpoint), draft=True)
    assert acceptance() < 0.5  # another model's drafts
    llm.update_weights(pairs_of(checkpoints["llama"]), draft=True)
    assert acceptance() == 1.0

"""Tensor parallelism on 8 CPU host devices: same tokens and logits as one device."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jvllm import LLM, SamplingParams
from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import LoadedModel, load_model
from jvllm.parallel.mesh import make_mesh
from jvllm.runner.input_batch import pack_rows
from jvllm.runner.model_runner import ModelRunner
from jvllm.testing import make_checkpoint
from tests.models.test_forward import Row, assert_close, random_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory, tokenizer_dir):
    """8 query heads over 2 KV heads, so TP=8 splits queries and replicates KV heads."""
    path = tmp_path_factory.mktemp("wide") / "llama8"
    return make_checkpoint("llama", path, tokenizer_dir, num_attention_heads=8, head_dim=16)


def prompt_batch() -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"prompt_token_ids": [int(t) for t in rng.integers(6, 500, size=n)]} for n in (3, 40, 90)
    ]


def generate(path, tp: int) -> list[list[int]]:
    """Greedy token ids; also checks that serving compiles nothing warm-up did not."""
    llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE)
    warm = llm.get_metrics()["num_compilations"]
    outs = llm.generate(prompt_batch(), GREEDY, use_tqdm=False)
    assert llm.get_metrics()["num_compilations"] == warm
    return [o.outputs[0].token_ids for o in outs]


def test_eight_host_devices():
    assert len(jax.devices()) >= 8


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_outputs_identical(checkpoints, arch, tp):
    assert generate(checkpoints[arch], tp) == generate(checkpoints[arch], 1)


def small_runner(loaded: LoadedModel, mesh: Mesh | None = None) -> ModelRunner:
    """16 blocks of 16 tokens; up to 8 sequences of 256 tokens, 64 tokens a step."""
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    return ModelRunner(loaded, 16, CacheConfig(block_size=16), scheduler, mesh)


def test_tp8_with_replicated_kv_heads(wide_checkpoint):
    assert generate(wide_checkpoint, 8) == generate(wide_checkpoint, 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_logits_match_and_shards_are_split(checkpoints, tp):
    path = checkpoints["qwen3"]  # 4 query heads, 2 KV heads: TP=4 replicates KV heads
    ids = random_ids(37, seed=1)
    rows = [Row(ids, 0, [1, 2, 3])]
    one = small_runner(load_model(path)).forward_logits(rows, True)[0]
    mesh = make_mesh(tp)
    loaded = load_model(path, mesh=mesh)
    runner = small_runner(loaded, mesh)
    many = runner.forward_logits(rows, True)[0]
    assert_close(many, one)
    layer = loaded.params["model"]["layers_0"]
    full_q = layer["self_attn"]["q_proj"]["weight"].shape
    for w, axis in [
        (layer["self_attn"]["q_proj"]["weight"], 0),
        (layer["self_attn"]["k_proj"]["weight"], 0),
        (layer["self_attn"]["o_proj"]["weight"], 1),
        (layer["mlp"]["gate_proj"]["weight"], 0),
        (layer["mlp"]["down_proj"]["weight"], 1),
        (loaded.params["model"]["embed_tokens"]["embedding"], 0),
    ]:
        shards = w.addressable_shards
        assert len(shards) == tp
        assert all(s.data.shape[axis] == w.shape[axis] // tp for s in shards)
    assert full_q[0] == 4 * 32
    k_cache = runner.caches[0][0]
    assert all(s.data.shape[2] == k_cache.shape[2] // tp for s in k_cache.addressable_shards)
    assert k_cache.shape[2] == max(2, tp)


def test_indivisible_sizes_rejected(checkpoints):
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=8, **ENGINE)


def test_too_few_devices(checkpoints):
    with pytest.raises(ValueError, match="needs 16 devices"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=16, **ENGINE)


def _compiled_forward(path, tp: int) -> tuple[str, str, ModelRunner]:
    """The TP forward of the smallest bucket: lowered StableHLO and compiled HLO text."""
    mesh = make_mesh(tp)
    loaded = load_model(path, mesh=mesh)
    runner = small_runner(loaded, mesh)
    shape = runner.batch_shape(16)
    packed = runner._put(pack_rows([], shape, runner.block_size))
    lowered = runner._forward_fn.lower(
        loaded.params, runner.caches, packed, runner.last_sampled, shape=shape
    )
    return lowered.as_text(), lowered.compile().as_text(), runner


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied lm_head
def test_attention_and_lm_head_run_per_device(checkpoints, arch):
    """Each layer's attention and the vocab projection are shard_map bodies, and no
    collective moves a weight or a KV cache: only the [S, V] logits are gathered."""
    lowered, compiled, runner = _compiled_forward(checkpoints[arch], 2)
    spec = runner.spec
    assert lowered.count("sdy.manual_computation") == spec.num_layers + 1
    gathered = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} all-gather\(", compiled)
    shape = runner.batch_shape(16)
    assert gathered == [("f32", f"{shape.num_seqs},{spec.vocab_size}")], gathered
    assert "all-to-all" not in compiled and "collective-permute" not in compiled


def test_draft_proposers_under_tensor_parallelism(tiny_eagle):
    """A draft model and an EAGLE head sharded with the target at TP=2: the greedy
    tokens, and the proposer's acceptance counts, of one device."""
    target, draft, head = tiny_eagle
    configs = (
        {"model": draft, "num_speculative_tokens": 3},
        {"method": "eagle", "model": head, "num_speculative_tokens": 3},
    )
    # One token bucket: quick to warm up; the longer prompt is chunked.
    engine = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [
        {"prompt_token_ids": [4 + (i * j) % 4 for j in range(n)]} for i, n in enumerate((3, 20))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for config in configs:
        runs = []
        for tp in (1, 2):
            llm = LLM(target, speculative_config=config, tensor_parallel_size=tp, **engine)
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = llm.get_metrics()
            runs.append(
                ([o.outputs[0].token_ids for o in outs], m["spec_decode_num_accepted_tokens"])
            )
        assert runs[0] == runs[1] and runs[0][1] > 0, config


@pytest.fixture(scope="module")
def tiny_eagle(tmp_path_factory):
    """A vocabulary-8 llama (4 query and 2 KV heads), a one-layer draft and an EAGLE head."""
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.eagle import make_eagle_head

    root = tmp_path_factory.mktemp("tiny_eagle")
    write_word_tokenizer(root / "tok", 8)
    wide = dict(initializer_range=0.5)
    target = make_checkpoint("llama", root / "target", root / "tok", **wide)
    draft = make_checkpoint(
        "llama", root / "draft", root / "tok", seed=4, num_hidden_layers=1, **wide
    )
    head = make_eagle_head(target, root / "head", seed=3, init_std=0.5)
    return str(target), str(draft), str(head)

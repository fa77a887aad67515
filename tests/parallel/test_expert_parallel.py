"""Mixture-of-experts models on 4 CPU host devices: tensor parallel (experts split on
their intermediate axis) and expert parallel (whole experts per device) give the
logits and greedy tokens of one device; expert parallelism keeps 1/ep of the expert
bytes on each device and no collective moves an expert weight."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.models.loader import load_model
from jvllm.parallel.mesh import make_mesh
from jvllm.runner.input_batch import pack_rows
from jvllm.testing.moe_checkpoints import MOE_ARCHITECTURES
from tests.models.test_forward import Row, assert_close, random_ids
from tests.parallel.test_tensor_parallel import small_runner

SPLITS = [(2, False), (2, True), (4, True)]  # (tensor_parallel_size, expert parallel)
SPLIT_IDS = ["tp2", "tp2-ep", "tp4-ep"]


@pytest.fixture(scope="module")
def one_device_logits(moe_checkpoints):
    rows = [Row(random_ids(37, seed=1), 0, [1, 2, 3]), Row(random_ids(5, seed=2), 0, [4])]
    return rows, {
        a: small_runner(load_model(p)).forward_logits(rows, True)
        for a, p in moe_checkpoints.items()
    }


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("tp,ep", SPLITS, ids=SPLIT_IDS)
def test_logits_equal_one_device(moe_checkpoints, one_device_logits, arch, tp, ep):
    rows, want = one_device_logits
    mesh = make_mesh(tp)
    runner = small_runner(load_model(moe_checkpoints[arch], mesh=mesh, expert_parallel=ep), mesh)
    for got, ref in zip(runner.forward_logits(rows, True), want[arch], strict=True):
        assert_close(got, ref)


@pytest.mark.parametrize("tp,ep", SPLITS, ids=SPLIT_IDS)
def test_greedy_tokens_equal_one_device(moe_checkpoints, tp, ep):
    path = str(moe_checkpoints["qwen2_moe"])  # a shared expert and a dense layer too
    engine = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(6, 500, n)]} for n in (3, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for kwargs in ({}, {"tensor_parallel_size": tp, "enable_expert_parallel": ep}):
        outs = LLM(path, **engine, **kwargs).generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def expert_leaves(params) -> list:
    return [
        w
        for name, layer in params["model"].items()
        if name.startswith("layers_") and "experts" in layer["mlp"]
        for w in layer["mlp"]["experts"].values()
    ]


@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_holds_its_share_of_the_experts(moe_checkpoints, tp):
    loaded = load_model(moe_checkpoints["olmoe"], mesh=make_mesh(tp), expert_parallel=True)
    experts = expert_leaves(loaded.params)
    total = sum(int(w.nbytes) for w in experts)
    held: dict = {}
    for w in experts:
        assert all(s.data.shape[0] == w.shape[0] // tp for s in w.addressable_shards)
        for s in w.addressable_shards:
            held[s.device] = held.get(s.device, 0) + int(s.data.nbytes)
    assert len(held) == tp and all(b == total // tp for b in held.values())


def collective_shapes(compiled_hlo: str) -> list[tuple[str, str]]:
    """(collective, shape) of every collective's result in a compiled HLO module."""
    ops = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"
    pattern = rf"= \(?(\w+\[[\d,]*\])[^=]*? ({ops})(?:-start)?\("
    return [(op, shape) for shape, op in re.findall(pattern, compiled_hlo)]


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_no_collective_moves_an_expert_weight(moe_checkpoints, ep):
    mesh = make_mesh(2)
    loaded = load_model(moe_checkpoints["qwen3_moe"], mesh=mesh, expert_parallel=ep)
    runner = small_runner(loaded, mesh)
    shape = runner.batch_shape(16)
    packed = runner._put(pack_rows([], shape, runner.block_size))
    lowered = runner._forward_fn.lower(
        loaded.params, runner.caches, packed, runner.last_sampled, shape=shape
    )
    collectives = collective_shapes(lowered.compile().as_text())
    assert collectives, "a split model reduces its partial sums"
    inter, hidden = loaded.spec.moe.intermediate_size, loaded.spec.hidden_size
    # A stack of experts [E', I', H] or [E', H, I'] (I' = I or I / 2), or one whole expert.
    sizes = f"({inter}|{inter // 2})"
    expert_like = re.compile(
        rf"\[\d+,({sizes},{hidden}|{hidden},{sizes})\]|\[({inter},{hidden}|{hidden},{inter})\]"
    )
    moved = [(op, s) for op, s in collectives if expert_like.search(s)]
    assert not moved, moved
    # The experts' partial sums are all-reduced as [T, H] activations.
    assert ("all-reduce", f"f32[{shape.num_tokens},{hidden}]") in collectives


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pipeline_parallel_size": 2},
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True},
    ],
    ids=["pp2", "pp2-tp2-ep"],
)
def test_pipeline_stages_give_one_devices_tokens(moe_checkpoints, kwargs):
    path = str(moe_checkpoints["olmoe"])  # 2 layers, both sparse: one per stage
    engine = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(6, 500, n)]} for n in (3, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for extra in ({}, kwargs):
        outs = LLM(path, **engine, **extra).generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_stages_with_unlike_layers_are_refused(moe_checkpoints):
    """Qwen2-MoE's test model: layer 0 dense, layer 1 sparse (decoder_sparse_step=2)."""
    with pytest.raises(ValueError, match="every stage's layer 0 to be alike"):
        load_model(moe_checkpoints["qwen2_moe"], mesh=make_mesh(1, pipeline_parallel_size=2))

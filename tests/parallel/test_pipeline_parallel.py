"""Pipeline parallelism on 8 CPU host devices: the same tokens and logits as one device,
and each device holding only its stage's layers and KV cache."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import load_model
from jvllm.parallel.mesh import make_mesh
from jvllm.parallel.pipeline import schedule_utilization
from jvllm.runner.input_batch import cut_rows, micro_batch_tokens, pack_micro_batches
from jvllm.runner.model_runner import ModelRunner
from jvllm.sampling_params import BeamSearchParams
from jvllm.testing import make_checkpoint
from tests.models.test_forward import Row, assert_close, random_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
LAYERS = 4


@pytest.fixture(scope="module")
def deep(tmp_path_factory, tokenizer_dir):
    """4-layer checkpoints: llama (4 query heads over 2 KV heads) and qwen3 (q/k norms,
    tied embeddings), so PP=4 puts one layer on each stage."""
    root = tmp_path_factory.mktemp("deep")
    return {
        arch: make_checkpoint(arch, root / arch, tokenizer_dir, num_hidden_layers=LAYERS)
        for arch in ("llama", "qwen3")
    }


def prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"prompt_token_ids": [int(t) for t in rng.integers(6, 500, size=n)]}
        for n in (3, 40, 90, 7, 25)
    ]


def generate(path, tp: int = 1, pp: int = 1, **extra) -> list[list[int]]:
    """Greedy token ids; serving compiles nothing warm-up did not."""
    llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE, **extra)
    warm = llm.get_metrics()["num_compilations"]
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert llm.get_metrics()["num_compilations"] == warm
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(deep):
    return {arch: generate(path) for arch, path in deep.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pp,tp", [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_greedy_outputs_identical(deep, reference, arch, pp, tp):
    assert generate(deep[arch], tp, pp) == reference[arch]


def test_one_batch_in_flight_and_chunked_prefill(deep, reference):
    """One micro-batch (no pipelining), and prompts chunked over several steps (a
    16-token budget), give the same tokens."""
    path = deep["llama"]
    assert generate(path, 1, 2, pipeline_micro_batches=1) == reference["llama"]
    llm = LLM(
        str(path),
        pipeline_parallel_size=4,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference["llama"]


def test_sampling_features_under_pipeline_stages(deep):
    """Prompt logprobs (every position's hidden state, reordered from the micro-batches),
    seeded sampling with n = 2 (forked blocks, copy-on-write), penalties and beam search
    give one device's results at PP=2 x TP=2."""
    params = SamplingParams(
        temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True,
        prompt_logprobs=3, logprobs=2, repetition_penalty=1.2,
    )  # fmt: skip
    outs, beams = [], []
    for tp, pp in ((1, 1), (2, 2)):
        llm = LLM(str(deep["qwen3"]), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
        outs.append(llm.generate(prompts()[:3], params, use_tqdm=False))
        beams.append(llm.beam_search(prompts()[:2], BeamSearchParams(beam_width=3, max_tokens=6)))
    for one, staged in zip(*outs, strict=True):
        assert [c.token_ids for c in staged.outputs] == [c.token_ids for c in one.outputs]
        for a, b in zip(staged.prompt_logprobs[1:], one.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
    for one, staged in zip(*beams, strict=True):
        assert [b.tokens for b in staged.sequences] == [b.tokens for b in one.sequences]


def test_swap_and_host_tier_under_pipeline_stages(deep):
    """A starved cache at PP=2: swap preemption (seeded n = 3 siblings sharing a prefix)
    and the prefix cache's host tier (a prefix evicted between its users) give one
    device's tokens; blocks really went to the host and came back."""
    rng = np.random.default_rng(9)
    path = str(deep["llama"])
    prefix = [int(t) for t in rng.integers(6, 500, size=70)]
    batch = [{"prompt_token_ids": prefix + [int(t) for t in rng.integers(6, 500, 9 + i)]}
             for i in range(6)]  # fmt: skip
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    want = LLM(path, **ENGINE).generate(batch, params, use_tqdm=False)
    starved = dict(ENGINE, num_gpu_blocks_override=24, preemption_mode="swap")
    llm = LLM(path, pipeline_parallel_size=2, **starved)
    got = llm.generate(batch, params, use_tqdm=False)
    tokens = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]
    assert tokens(got) == tokens(want)
    assert llm.get_metrics()["num_swapped_out_blocks"] > 0

    shared = prefix * 2
    batches = []
    for i in range(4):
        batches.append([{"prompt_token_ids": shared + [7 + i]}])
        batches.append([{"prompt_token_ids": [int(t) for t in rng.integers(6, 500, 230)]}])
    runs = {}
    for pp, tier in ((1, 0.0), (2, 0.001)):
        llm = LLM(path, pipeline_parallel_size=pp, num_gpu_blocks_override=18,
                  kv_offloading_size=tier, **ENGINE)  # fmt: skip
        runs[pp] = [llm.generate(b, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                    for b in batches]  # fmt: skip
    assert runs[2] == runs[1]
    assert llm.get_metrics()["prefix_cache_host_hits"] > 0


def test_ngram_speculation_under_pipeline_stages(deep, reference):
    """Rows of 1 + k tokens (cut across micro-batches like any row) verify n-gram drafts:
    the greedy tokens of plain decoding on one device, with drafts accepted; a prompt
    that repeats itself gives the drafts something to find."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1}  # fmt: skip
    path = str(deep["llama"])
    assert generate(path, 2, 2, speculative_config=ngram) == reference["llama"]
    llm = LLM(path, pipeline_parallel_size=2, speculative_config=ngram, **ENGINE)
    looping = [{"prompt_token_ids": [11, 12, 13, 14, 15] * 8}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, **ENGINE).generate(looping, params, use_tqdm=False)
    spec = llm.generate(looping, params, use_tqdm=False)
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0


def runner_for(path, tp: int, pp: int) -> tuple[ModelRunner, object]:
    mesh = make_mesh(tp, pipeline_parallel_size=pp) if tp * pp > 1 else None
    loaded = load_model(path, mesh=mesh)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    return ModelRunner(loaded, 16, CacheConfig(block_size=16), scheduler, mesh), loaded


@pytest.mark.parametrize("pp,tp", [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_logits_within_float32_tolerance(deep, pp, tp):
    """Every position's logits of two rows (one prefill of 37 tokens, one of 5 that a
    second micro-batch carries) against one device."""
    path = deep["qwen3"]
    rows = [Row(random_ids(37, seed=1), 0, [1, 2, 3]), Row(random_ids(5, seed=2), 0, [4])]
    one = runner_for(path, 1, 1)[0].forward_logits(rows, True)
    many = runner_for(path, tp, pp)[0].forward_logits(rows, True)
    for a, b in zip(many, one, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("pp,tp", [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_each_device_holds_its_stage(deep, pp, tp):
    """Per-device weight bytes are the whole model's / (pp * tp) (the vocabulary splits
    over every device), and a device's KV arrays hold only its stage's layers."""
    path = deep["llama"]
    runner, loaded = runner_for(path, tp, pp)
    one = load_model(path)
    # The model as built: at tp = 4 each of the 2 KV heads is held twice.
    total = loaded.weight_bytes
    if tp <= 2:
        assert total == one.weight_bytes
    held = loaded.bytes_per_device()
    assert len(held) == pp * tp
    norms = sum(
        int(np.prod(x.shape)) * x.dtype.itemsize
        for path_, x in jax.tree_util.tree_leaves_with_path(one.params)
        if "norm" in jax.tree_util.keystr(path_)
    )
    for device, nbytes in held.items():
        # Norm weights are replicated within a stage; everything else is split.
        assert nbytes <= total / (pp * tp) + norms, (device, nbytes, total)
        assert nbytes >= (total - norms) / (pp * tp)
    q = loaded.params["model"]["layers_0"]["self_attn"]["q_proj"]["weight"]
    assert q.shape[0] == pp  # layer 0 of every stage
    stages = {}
    for shard in q.addressable_shards:
        stage = shard.index[0].start
        stages.setdefault(stage, set()).add(shard.device)
        assert shard.data.shape[0] == 1
    mesh_devices = loaded.module.mesh.devices
    assert {s: set(mesh_devices[s]) for s in range(pp)} == stages
    assert len(runner.caches) == LAYERS // pp
    k = runner.caches[0][0]
    for shard in k.addressable_shards:
        assert shard.data.shape[0] == 1 and shard.data.shape[3] == k.shape[3] // tp


def test_no_weight_crosses_stages(deep):
    """The PP=2 x TP=2 step moves activations between stages (collective-permute), and
    no collective moves a weight or a KV layer (no collective has a shape of one, whole
    or a device's slice; 48-token micro-batches keep activations' shapes apart)."""
    runner, loaded = runner_for(deep["llama"], 2, 2)
    shape = runner.batch_shape(48)
    packed, _ = pack_micro_batches([], shape, runner.block_size)
    compiled = (
        runner._forward_fn.lower(
            loaded.params, runner.caches, runner._put(packed), runner.last_sampled, shape=shape
        )
        .compile()
        .as_text()
    )
    assert "collective-permute" in compiled
    arrays = [*jax.tree.leaves(loaded.params), *jax.tree.leaves(runner.caches)]
    held = {tuple(a.shape) for a in arrays}
    held |= {tuple(s.data.shape) for a in arrays for s in a.addressable_shards}
    held |= {shape[1:] for shape in list(held) if len(shape) > 2}  # one stage's, squeezed
    pattern = r"= \w+\[([\d,]*)\]\{[^}]*\} (all-gather|all-reduce|all-to-all|collective-permute)\("
    moved = re.findall(pattern, compiled)
    assert moved
    for dims, op in moved:
        dims = tuple(int(d) for d in dims.split(",") if d)
        assert dims not in held, (op, dims)


def test_bad_configurations(deep, checkpoints):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must divide num_hidden"):
        LLM(str(deep["llama"]), pipeline_parallel_size=3, **ENGINE)
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=4 x tensor_parallel_size=4 needs 16"
    ):
        LLM(str(deep["llama"]), pipeline_parallel_size=4, tensor_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match="does not support a draft model or an EAGLE head"):
        LLM(
            str(deep["llama"]),
            pipeline_parallel_size=2,
            speculative_config={"model": str(deep["qwen3"]), "num_speculative_tokens": 2},
            **ENGINE,
        )
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(str(deep["llama"]), pipeline_parallel_size=0, **ENGINE)


def test_cut_rows_makes_equal_micro_batches():
    """Random steps: every micro-batch but the last gets exactly ceil(T / M) tokens; each
    row's pieces, in order, give back its tokens at consecutive positions; only a row's
    first piece takes its token from the previous step."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = [
            Row(
                [int(t) for t in rng.integers(0, 99, size=rng.integers(1, 40))],
                int(rng.integers(0, 50)),
                [1, 2, 3],
                int(rng.integers(0, 8)) if rng.random() < 0.5 else None,
            )
            for _ in range(rng.integers(1, 12))
        ]
        parts = int(rng.integers(1, 6))
        groups = cut_rows(rows, parts)
        total = sum(len(r.token_ids) for r in rows)
        size = micro_batch_tokens(rows, parts)
        counts = [sum(len(p.token_ids) for p in g) for g in groups]
        expected = [max(0, min(size, total - g * size)) for g in range(parts)]
        assert counts == expected
        pieces = [p for g in groups for p in g]
        i = 0
        for row in rows:
            tokens, position, first = [], row.start_position, True
            while len(tokens) < len(row.token_ids):
                piece = pieces[i]
                assert piece.start_position == position
                assert piece.prev_step_row == (row.prev_step_row if first else None)
                tokens += list(piece.token_ids)
                position += len(piece.token_ids)
                first, i = False, i + 1
            assert tokens == list(row.token_ids)
        assert i == len(pieces)


def test_schedule_utilization():
    busy, capacity = schedule_utilization([10, 10, 10, 10], 4)
    assert busy / capacity == pytest.approx(4 / 7)
    busy, capacity = schedule_utilization([40], 4)
    assert busy / capacity == pytest.approx(1 / 4)

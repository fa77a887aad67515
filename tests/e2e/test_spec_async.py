"""Speculative decoding with async scheduling on (`engine/spec_step.py`).

Each step's forward is queued before the output processor commits the step before, and
the outputs stay those of plain decoding (greedy, under chunked prefill and preemption)
and of the synchronous order (seeded sampling through the rejection sampler, stop
strings trailing by a step). The chi-square check of seeded sampling with a draft model
(`test_spec_decode.py`) runs with this order too: async scheduling is the default.
"""

from __future__ import annotations

import pytest

from jvllm import LLM, SamplingParams, StructuredOutputsParams
from tests.e2e.test_eagle import (
    DRAFT_PROMPTS,
    K,
    seeded_draws_alone_as_batched,
    speculated_like_plain,
)

# Budget 16 chunks the longer prompts; 9 blocks of 16 force preemptions.
SMALL = dict(max_model_len=128, max_num_seqs=6, max_num_batched_tokens=32)
ENGINE = dict(
    max_model_len=96, max_num_seqs=6, max_num_batched_tokens=16, num_gpu_blocks_override=9
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A vocabulary-8 llama and a random EAGLE-1 head for it (`test_eagle.py`'s)."""
    from jvllm.testing import make_checkpoint
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.eagle import make_eagle_head

    root = tmp_path_factory.mktemp("eagle_async")
    write_word_tokenizer(root / "tok", 8)
    target = make_checkpoint("llama", root / "target", root / "tok", initializer_range=0.5)
    head = make_eagle_head(target, root / "head", seed=3, init_std=0.5)
    return str(target), str(head)


def _record_order(llm: LLM) -> list[str]:
    """The engine's calls in order: "forward" (a step queued), "propose" (drafts asked
    for) and "commit" (the output processor's commit of a step)."""
    engine, events = llm.llm_engine, []
    forward, propose, commit = (
        engine.runner.forward,
        engine.speculator.propose,
        engine.output_processor.commit,
    )

    def on_forward(sched):
        events.append("forward")
        forward(sched)

    def on_propose(sequences):
        events.append("propose")
        propose(sequences)

    def on_commit(*args):
        events.append("commit")
        return commit(*args)

    engine.runner.forward = on_forward
    engine.speculator.propose = on_propose
    engine.output_processor.commit = on_commit
    return events


def test_eagle_with_async_scheduling_overlaps_commits_and_decodes_as_plain(tiny):
    target, head = tiny
    config = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    llm, _ = speculated_like_plain(target, ENGINE, config)
    engine = llm.llm_engine
    assert engine.async_scheduling

    # Every commit but the last comes after the next step's forward (the device runs
    # while the host commits), and after the proposal it feeds.
    events = _record_order(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(DRAFT_PROMPTS[:3], greedy, use_tqdm=False)
    commits = [i for i, e in enumerate(events) if e == "commit"]
    forwards = [i for i, e in enumerate(events) if e == "forward"]
    assert len(commits) == len(forwards) > 5
    for n, at in enumerate(commits[:-1]):
        assert forwards[n + 1] < at, events  # step n + 1 queued before step n commits
        assert "propose" in events[forwards[n] : forwards[n + 1]], events

    seeded_draws_alone_as_batched(llm)


def test_eagle_seeded_and_stopped_outputs_equal_the_synchronous_order(tiny):
    """Seeded sampling (rejection sampler), stop strings and a ban: the same
    tokens with async scheduling on as off."""
    target, head = tiny
    config = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in range(4)
    ] + [SamplingParams(temperature=0.0, max_tokens=16, stop=[w]) for w in ("w5", "w6")]
    # A multi-word ban (it reads the newest token, which the scheduler has) beside them.
    params.append(
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=["w5 w6"])
    )
    prompts = DRAFT_PROMPTS + DRAFT_PROMPTS[:1]
    # Chunked prefill; blocks enough that no request is preempted (a preempted
    # request's drafts start over, so seeded draws depend on when it happens).
    engine = dict(max_model_len=96, max_num_seqs=6, max_num_batched_tokens=32)
    outs = {}
    for overlap in (True, False):
        llm = LLM(target, speculative_config=config, async_scheduling=overlap, **engine)
        assert llm.llm_engine.async_scheduling is overlap
        got = llm.generate(prompts, params, use_tqdm=False)
        outs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got]
        m = llm.get_metrics()
        assert m["spec_decode_num_drafts"] > 0 and m["num_preemptions"] == 0
        assert m["num_free_blocks"] == m["num_total_blocks"]
        del llm
    assert outs[True] == outs[False]
    assert any(reason == "stop" for _, reason in outs[True])
    banned = outs[True][6][0]
    assert not any(banned[i : i + 2] == [5, 6] for i in range(len(banned)))


def test_grammar_rows_beside_speculating_rows_commit_the_step_before_first(
    checkpoints, monkeypatch
):
    """n-gram drafts beside rows with a grammar (no drafts; their next mask needs the
    step before committed, so that step commits before the next sampler): the same
    outputs with async scheduling on as off, every output of the grammar."""
    from jvllm.engine import spec_step
    from tests.helpers import prompts, token_prompts

    firsts: list[bool] = []
    needs = spec_step._needs_commit_first

    def recording(*args):
        firsts.append(needs(*args))
        return firsts[-1]

    monkeypatch.setattr(spec_step, "_needs_commit_first", recording)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    choice = StructuredOutputsParams(choice=["alpha beta gamma", "delta"])
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 4
    params += [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=choice)] * 2
    ps = token_prompts(prompts(seed=5)[:6])
    outs = {}
    for overlap in (True, False):
        llm = LLM(
            str(checkpoints["llama"]), speculative_config=ngram, async_scheduling=overlap, **SMALL
        )
        outs[overlap] = [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]
        assert llm.get_metrics()["spec_decode_num_drafts"] > 0
        del llm
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert all(o.text in choice.choice for o in outs[True][4:])
    assert any(firsts)

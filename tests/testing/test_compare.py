"""vLLM's comparison rules in `jvllm.testing`: check_outputs_equal and check_logprobs_close
on hand-made outputs (the runners' own outputs: test_runners.py, test_pytest_plugin.py)."""

from __future__ import annotations

import re

import pytest

from jvllm.outputs import Logprob
from jvllm.testing import check_logprobs_close, check_outputs_equal
from jvllm.testing.compare import Sample, compare_logprobs


def lp(**tops: float) -> dict[int, float]:
    """{token id: logprob} from keywords t<id>=logprob."""
    return {int(k[1:]): v for k, v in tops.items()}


# Prompt 0 agrees; prompt 1 differs at output token 2 (each token in the other's top-3).
HF = [
    ([4, 5, 6], "abc", [lp(t4=-0.1, t9=-3), lp(t5=-0.2, t8=-2), lp(t6=-1.0, t7=-1.01, t3=-4)]),
    ([7, 8, 6, 1], "xyz!", [lp(t7=-0.3), lp(t8=-0.5), lp(t6=-1.0, t7=-1.01, t3=-4), lp(t1=-1)]),
]
NEAR_TIE = [
    HF[0],
    ([7, 8, 7, 2], "xyzw", [lp(t7=-0.3), lp(t8=-0.5), lp(t7=-0.99, t6=-1.0, t3=-4), lp(t2=-1)]),
]


def test_a_near_tie_passes_with_a_warning_and_stops_the_comparison_of_that_prompt():
    with pytest.warns(UserWarning, match="prompt 1: hf and jvllm differ at output token 2"):
        check_logprobs_close(outputs_0_lst=HF, outputs_1_lst=NEAR_TIE, name_0="hf", name_1="jvllm")
    (d,) = compare_logprobs(HF, NEAR_TIE, "hf", "jvllm")
    assert (d.prompt_index, d.position, d.tokens, d.near_tie) == (1, 2, (6, 7), True)


def test_a_token_outside_the_other_sides_top_k_fails_with_both_logprobs_of_both_tokens():
    other = [HF[0], ([7, 8, 9], "xyq", [lp(t7=-0.3), lp(t8=-0.5), lp(t9=-0.2, t6=-5.0)])]
    with pytest.raises(AssertionError) as failed:
        check_logprobs_close(outputs_0_lst=HF, outputs_1_lst=other, name_0="hf", name_1="jvllm")
    message = str(failed.value)
    assert "prompt 1: hf and jvllm differ at output token 2 (the 2 before it are equal)" in message
    rows = {line.split()[0]: line.split() for line in message.splitlines()[2:4]}
    # hf chose 6 (-1.0 in hf, -5.0 in jvllm); jvllm chose 9 (not in hf's top-3).
    assert rows["hf"][1] == "6" and rows["hf"][-2:] == ["-1.0000", "-5.0000"]
    assert rows["jvllm"][1] == "9" and "< -4.0000 (not top-3)" in message
    assert "jvllm's token is not in hf's top-3" in message
    assert "hf text: 'xyz!'" in message and "jvllm text: 'xyq'" in message
    assert "prompt 0" not in message


def test_logprob_objects_and_skipped_leading_tokens_are_read_as_vllm_reads_them():
    """vLLM's num_outputs_0_skip_tokens drops the first side's leading tokens; jvllm's
    Logprob objects count by their .logprob."""
    tops = [{4: Logprob(-0.1)}, {5: Logprob(-0.2)}, {7: Logprob(-0.99), 6: Logprob(-1.0)}]
    ours = [([0, 4, 5, 7], "_abd", [{0: Logprob(-2.0)}, *tops])]
    (d,) = compare_logprobs(ours, HF[:1], "jvllm", "hf", num_outputs_0_skip_tokens=1)
    assert (d.position, d.tokens, d.near_tie) == (2, (7, 6), True)
    assert d.logprobs[0] == {7: -0.99, 6: -1.0}
    with pytest.raises(ValueError, match="got 2 and 2 fields"):
        compare_logprobs([([1], "a")], [([1], "a")], "a", "b")


def test_outputs_equal_names_the_first_differing_output_token_and_its_text(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = tok("hello world").input_ids
    a, b = tok(" the quick brown fox").input_ids, tok(" the quick lazy dog").input_ids
    at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    left = [Sample((prompt + a, "hello world" + tok.decode(a)), tok, len(prompt))]
    right = [Sample((prompt + b, "hello world" + tok.decode(b)), tok, len(prompt))]
    with pytest.raises(AssertionError) as failed:
        check_outputs_equal(outputs_0_lst=left, outputs_1_lst=right, name_0="hf", name_1="jvllm")
    message = str(failed.value)
    assert f"prompt 0: hf and jvllm differ at output token {at} " in message
    assert repr(tok.decode([a[at]])) in message and repr(tok.decode([b[at]])) in message
    assert re.search(r"logprobs not recorded", message)
    # vLLM compares whole sequences: the prompts' ids too.
    bos = [Sample(([0, *prompt, *a], "hello world" + tok.decode(a)), tok, len(prompt) + 1)]
    with pytest.raises(AssertionError, match=r"prompt 0: tokenized differently: hf \[0, "):
        check_outputs_equal(outputs_0_lst=bos, outputs_1_lst=left, name_0="hf", name_1="jvllm")


def test_texts_may_differ_only_by_a_trailing_incomplete_character():
    same_ids = [([1, 2], "ab\ufffd")], [([1, 2], "ab")]
    check_outputs_equal(
        outputs_0_lst=same_ids[0], outputs_1_lst=same_ids[1], name_0="a", name_1="b"
    )
    with pytest.raises(AssertionError, match="equal token ids, different texts"):
        check_outputs_equal(
            outputs_0_lst=[([1], "a ")], outputs_1_lst=[([1], "a")], name_0="a", name_1="b"
        )

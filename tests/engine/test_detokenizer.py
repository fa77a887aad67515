"""The detokenizer's decode equals Transformers' `tokenizer.decode`, which it bypasses
for fast tokenizers that clean up no spaces."""

from __future__ import annotations

import numpy as np
import pytest

from jvllm.demo import DEMO_MODEL_DIR
from jvllm.engine.detokenizer import decoder


@pytest.mark.parametrize("source", ["demo", "test"])
@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_equals_transformers(source, clean_up, tokenizer_dir):
    from transformers import AutoTokenizer

    path = DEMO_MODEL_DIR if source == "demo" else tokenizer_dir
    tok = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=clean_up)
    decode = decoder(tok)
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = [int(t) for t in rng.integers(0, len(tok), rng.integers(1, 12))]
        for skip in (False, True):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("source", ["demo", "test"])
@pytest.mark.parametrize("clean_up", [False, True])
def test_incremental_text_equals_transformers_decode(source, clean_up, tokenizer_dir):
    """Fed one token at a time after a prompt, the text equals Transformers' decode of
    context and output less the context's own text: by the tokenizers library's
    DecodeStream where the backend decodes alone, by the offset rule otherwise."""
    from transformers import AutoTokenizer

    from jvllm.engine.detokenizer import IncrementalDetokenizer

    path = DEMO_MODEL_DIR if source == "demo" else tokenizer_dir
    tok = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=clean_up)
    texts = [
        "hello world, how are you today?",
        "Numbers 12345 and symbols: ($%) -- done.",
        "  leading spaces and\nnew lines\n\n end",
        "the quick brown fox jumps over the lazy dog",
    ]
    for prompt in texts:
        for output in texts:
            ctx = tok.encode(prompt, add_special_tokens=False)
            out = tok.encode(" " + output, add_special_tokens=False)
            detok = IncrementalDetokenizer(tok, ctx, True, [], False)
            for token in out:
                detok.append(token)
            tail = ctx[-5:]
            whole = tok.decode(tail + out, skip_special_tokens=True)
            assert detok.output_text == whole[len(tok.decode(tail, skip_special_tokens=True)) :]

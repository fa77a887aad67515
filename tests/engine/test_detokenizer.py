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

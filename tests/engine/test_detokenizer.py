"""The detokenizer's decode equals Transformers' `tokenizer.decode`, which it bypasses
for fast tokenizers that clean up no spaces."""

from __future__ import annotations

import numpy as np
import pytest

from jvllm.demo import DEMO_MODEL_DIR
from jvllm.engine.detokenizer import decoder
from jvllm.engine.token_pieces import token_pieces


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


def _stream_text(backend, context: list[int], tokens: list[int], skip: bool) -> str:
    """The text the tokenizers library's DecodeStream gives for `tokens` after `context`."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=skip)
    if context:
        stream.step(backend, context)
    return "".join(d for t in tokens if (d := stream.step(backend, t)) is not None)


@pytest.mark.parametrize("source", ["demo", "test", "word"])
def test_standalone_pieces_leave_the_text_as_decode_stream_gives_it(
    source, tokenizer_dir, tmp_path
):
    """Random token sequences (byte tokens that split UTF-8 characters, special tokens,
    ids past the vocabulary, empty contexts among them) give, token for token, the text
    of a DecodeStream fed every token: skipping it for standalone tokens changes none."""
    from transformers import AutoTokenizer

    from jvllm.engine.detokenizer import IncrementalDetokenizer
    from jvllm.testing.checkpoints import write_word_tokenizer

    if source == "word":
        write_word_tokenizer(tmp_path, 64)
        path = tmp_path
    else:
        path = DEMO_MODEL_DIR if source == "demo" else tokenizer_dir
    tok = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False)
    backend = tok.backend_tokenizer
    vocab = len(tok)
    rng = np.random.default_rng(1)
    specials = sorted(backend.get_added_tokens_decoder())
    for trial in range(150):
        # Mostly ids from a small window (repeats: pieces learnt, then reused), some
        # specials and ids past the vocabulary.
        low = int(rng.integers(0, max(1, vocab - 40)))
        pool = [*range(low, min(vocab, low + 40)), *specials, vocab + 3]
        ids = [int(pool[i]) for i in rng.integers(0, len(pool), 40)]
        context, tokens = ids[: trial % 6], ids[6:]
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, context, skip, [], False)
            expected = ""
            for j, token in enumerate(tokens):
                detok.append(token)
                expected = _stream_text(backend, context, tokens[: j + 1], skip)
                assert detok.output_text == expected, (context, tokens[: j + 1], skip)
    # The short path was taken: most ids have a standalone piece.
    table = token_pieces(tok, backend)
    assert table is not None and sum(map(bool, table.pieces)) > len(table.pieces) // 2


def test_a_token_marked_special_later_leaves_the_table(tokenizer_dir):
    """Marking a vocabulary token special after its table was built rebuilds the table:
    the token's text is skipped with skip_special_tokens, as Transformers' decode does."""
    from transformers import AutoTokenizer

    from jvllm.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, clean_up_tokenization_spaces=False)
    ids = tok("hello world hello world", add_special_tokens=False)["input_ids"]
    assert token_pieces(tok, tok.backend_tokenizer).pieces[ids[1]]
    word = tok.convert_ids_to_tokens(ids[1])
    tok.add_special_tokens({"additional_special_tokens": [word]})
    assert not token_pieces(tok, tok.backend_tokenizer).pieces[ids[1]]
    detok = IncrementalDetokenizer(tok, [], True, [], False)
    for token in ids:
        detok.append(token)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=True)

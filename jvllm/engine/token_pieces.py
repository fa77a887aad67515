"""The text a token adds after any cleanly decoded text, where that never depends on
the text before it: the incremental detokenizer's short path.

Owns, per tokenizer, a table of "standalone" pieces, built once for all its ids. A
token is standalone when the tokenizer's decoder is one whose output is a
concatenation of per-token pieces (a Rust backend without a decoder joins token
strings with single spaces; the `ByteLevel` decoder concatenates token bytes and
decodes them as UTF-8), the token is no added or special token (skipped or not by
`skip_special_tokens`, passed through the decoder or not, depending on the version),
and its piece is text of its own: non-empty, whole UTF-8 characters (no U+FFFD).
Then, after any token sequence whose decode is non-empty and ends in a whole
character, decoding one more such token adds exactly its piece, and the tokenizers
library's `DecodeStream` would return that piece too (`detokenizer.py` relies on it).

Not owned: the stream state and stop strings (`detokenizer.py`); other decoders
(Metaspace, byte fallback, WordPiece, ...) get no table, and every token of theirs
goes through `DecodeStream`.
"""

from __future__ import annotations

import weakref
from typing import Any

from tokenizers import decoders

# Per fast tokenizer (the Python object, held weakly): its table, or None where its
# decoder is not one of the concatenating ones.
_TABLES: weakref.WeakKeyDictionary[Any, TokenPieces | None] = weakref.WeakKeyDictionary()


class TokenPieces:
    """`pieces[token]`: the token's standalone piece, or "" when it has none. Ids past
    the list (a model vocabulary padded beyond the tokenizer's) have none."""

    def __init__(self, backend: Any, joins_with_space: bool) -> None:
        size = backend.get_vocab_size(with_added_tokens=True)
        # Tokens added or marked special later change what is standalone (`token_pieces`
        # compares this count and rebuilds).
        self.num_added = len(backend.get_added_tokens_decoder())
        # Once per tokenizer, all ids at once (~25 ms for 32k ids, ~0.15 s for 150k; at
        # start-up, `detokenizer.build_token_pieces`): a step then never
        # meets an unknown one.
        texts = backend.decode_batch([[t] for t in range(size)], skip_special_tokens=False)
        separator = " " if joins_with_space else ""
        self.pieces: list[str] = [
            separator + text if text and "\ufffd" not in text else "" for text in texts
        ]
        for token in backend.get_added_tokens_decoder():
            if token < size:
                self.pieces[token] = ""


def token_pieces(tokenizer: Any, backend: Any) -> TokenPieces | None:
    """The table of a fast tokenizer whose Rust `backend` decodes for it, shared by all
    its sequences; None where its decoder does not concatenate pieces."""
    try:
        table = _TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: no table (every token decodes in Rust)
        return None
    else:
        if table is None or table.num_added == len(backend.get_added_tokens_decoder()):
            return table
    table = _TABLES[tokenizer] = _table(backend)
    return table


def _table(backend: Any) -> TokenPieces | None:
    decoder = backend.decoder
    if decoder is None:
        return TokenPieces(backend, joins_with_space=True)
    if type(decoder) is decoders.ByteLevel:
        return TokenPieces(backend, joins_with_space=False)
    return None

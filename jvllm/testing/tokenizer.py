"""A small byte-level BPE tokenizer trained on the fly, saved with a chat template."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = tuple(
    (
        "the quick brown fox jumps over a lazy dog while paged attention keeps every "
        "block of the cache busy and continuous batching schedules new requests at each "
        "step so that prefill and decode share one token budget hello world how are you "
        "today tell me a story about mountains rivers cities numbers 0 1 2 3 4 5 6 7 8 9 "
        "JAX XLA GPU kernel Triton tensor parallel mesh shard server client request "
        "response stream token model weights layer head norm rotary embedding vocabulary "
    ).split()
)


def _corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", ""]))
    # Every printable ASCII character appears, so any ASCII text round-trips.
    out.append("".join(chr(c) for c in range(32, 127)))
    return out


def make_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Trains and saves a tokenizer (BOS-prefixed, EOS `</s>`, chat template) to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(itertools.chain(_corpus()), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out

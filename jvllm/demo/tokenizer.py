"""The demo model's tokenizer: byte-level BPE trained on the corpus, with a chat template.

Owns training and saving it, and the one function that turns a chat turn into the ids
the model is trained on, so training and serving format turns alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jvllm.demo.corpus import PROMPTS

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLES = ("system", "user", "assistant")
# Llama-style: BOS once, then each turn as `<|role|>` newline content EOS newline. With
# tools, a system turn lists them Hermes-style first, and an assistant turn's calls are
# `<tool_call>` blocks before its content (the demo model was not trained on either).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\n\nYou may call one or more "
    "functions. Their signatures are within <tools></tools>:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\nFor each call, answer "
    'with <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call></s>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": "
    "{{ c['function']['name'] | tojson }}, \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>\n{% endfor %}"
    "{{ m['content'] if m['content'] is not none else '' }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(out_dir: Path, texts: Iterable[str], vocab_size: int) -> Any:
    """Trains a byte-level BPE on texts, saves it to out_dir and returns it (HF fast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, *(f"<|{r}|>" for r in ROLES)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*texts, *PROMPTS], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def chat_ids(tok: Any, prompt: str, answer: str) -> list[int]:
    """Ids of a user turn and the assistant's answer, as the chat template renders them."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    text = tok.apply_chat_template(messages, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))

"""The Transformers reference: `HfRunner` (vLLM's test runner of that name) and
`hf_greedy`, the greedy continuation jvllm's own tests compare against.

Owns loading a checkpoint with Transformers (torch; on CUDA when torch sees a GPU) and
its greedy, logprob and beam-search generation in the tuple shapes of vLLM's tests. The
comparison rules are `compare.py`'s. torch is a test dependency, imported here only.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from jvllm.testing.compare import Sample

Prompt = str | Sequence[int]

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def torch_dtype(dtype: str, model_dir: str | Path) -> torch.dtype:
    """The torch dtype of a jvllm/vLLM dtype name; "auto" is the checkpoint's, float32
    where config.json names none (as jvllm reads it)."""
    if dtype == "auto":
        config_file = Path(model_dir) / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_TORCH_DTYPES)}, got {dtype!r}")
    return _TORCH_DTYPES[dtype]


def _hf_generate(
    model: Any, ids: Sequence[int], max_new: int, eos: int | list[int] | None, **kwargs: Any
) -> Any:
    """One unpadded prompt through `model.generate` (greedy unless kwargs say otherwise)."""
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    kwargs = {"do_sample": False, "pad_token_id": eos_ids[0] if eos_ids else 0, **kwargs}
    with torch.no_grad():
        return model.generate(
            torch.tensor([list(ids)], device=model.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
            max_new_tokens=max_new,
            eos_token_id=eos_ids or None,
            **kwargs,
        )


def _until_eos(tokens: list[int], eos_ids: Sequence[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return tokens[:end]


def hf_greedy(
    hf_model: Any, ids: list[int], max_new: int, eos: int, **processors: Any
) -> list[int]:
    """Transformers' greedy continuation (through EOS); `processors` are generate()'s
    logits-processor arguments (sequence_bias, bad_words_ids, ...)."""
    out = _hf_generate(hf_model, ids, max_new, eos, **processors)
    return _until_eos(out[0, len(ids) :].tolist(), [eos])


class HfRunner:
    """`with HfRunner(model, dtype=...) as hf_model:`: a Transformers causal LM and its
    tokenizer, with vLLM's `generate_*` methods. Prompts are strings or token-id lists;
    a string prompt's text is part of the returned text (vLLM's convention), a token
    prompt's is not. EOS ids: the config's, the tokenizer's and generation_config's."""

    def __init__(
        self,
        model_name: str,
        tokenizer_name: str | None = None,
        dtype: str = "auto",
        is_sentence_transformer: bool = False,
        **model_kwargs: Any,
    ) -> None:
        """`is_sentence_transformer` (vLLM's): load the checkpoint with
        sentence-transformers instead, for `encode`."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_name = str(model_name)
        self.dtype = torch_dtype(dtype, model_name)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if is_sentence_transformer:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(self.model_name, device=device).to(self.dtype)
            self.tokenizer = self.model.tokenizer
            self.eos_token_ids = []
            return
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=self.dtype, **model_kwargs)
        self.model = model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or model_name)
        self.eos_token_ids = self._eos_ids()

    def _eos_ids(self) -> list[int]:
        found: list[int] = []
        for source in (self.model.config, self.model.generation_config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            found += [eos] if isinstance(eos, int) else list(eos or [])
        return sorted(set(found))

    def __enter__(self) -> HfRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _encode(self, prompt: Prompt) -> tuple[list[int], str]:
        """(prompt ids, the prompt's part of the returned text)."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids, prompt
        return [int(t) for t in prompt], ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def generate(self, prompts: Sequence[Prompt], **kwargs: Any) -> list[tuple[list, list]]:
        """`model.generate(**kwargs)` per prompt: ([prompt + output ids per sequence],
        [prompt + output text per sequence])."""
        kwargs = dict(kwargs)
        max_new = kwargs.pop("max_new_tokens", 16)
        results = []
        for prompt in prompts:
            ids, head = self._encode(prompt)
            out = _hf_generate(self.model, ids, max_new, self.eos_token_ids, **kwargs)
            rows = [_until_eos(row[len(ids) :], self.eos_token_ids) for row in out.tolist()]
            results.append(([ids + r for r in rows], [head + self._decode(r) for r in rows]))
        return results

    def generate_greedy(self, prompts: Sequence[Prompt], max_tokens: int) -> list[Sample]:
        """Per prompt: (prompt + output ids, prompt + output text)."""
        samples = []
        for prompt in prompts:
            ids, head = self._encode(prompt)
            out = _hf_generate(self.model, ids, max_tokens, self.eos_token_ids)
            new = _until_eos(out[0, len(ids) :].tolist(), self.eos_token_ids)
            samples.append(Sample((ids + new, head + self._decode(new)), self.tokenizer, len(ids)))
        return samples

    def generate_greedy_logprobs(
        self, prompts: Sequence[Prompt], max_tokens: int, num_logprobs: int
    ) -> list[Sample]:
        """Per prompt: (output ids, output text, [{token id: logprob} of the top
        `num_logprobs}` at each output token]), from the raw logits in float32."""
        samples = []
        for prompt in prompts:
            ids, _ = self._encode(prompt)
            out = _hf_generate(
                self.model, ids, max_tokens, self.eos_token_ids,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            new = _until_eos(out.sequences[0, len(ids) :].tolist(), self.eos_token_ids)
            top = [
                torch.log_softmax(step[0].float(), dim=-1).topk(num_logprobs)  # [V] -> top-k
                for step in out.logits[: len(new)]
            ]
            logprobs = [dict(zip(t.indices.tolist(), t.values.tolist(), strict=True)) for t in top]
            samples.append(Sample((new, self._decode(new), logprobs), self.tokenizer))
        return samples

    # vLLM's HfRunner names the top-k variant so; its plain one returns whole tensors.
    generate_greedy_logprobs_limit = generate_greedy_logprobs

    def generate_beam_search(
        self, prompts: Sequence[Prompt], beam_width: int, max_tokens: int
    ) -> list[tuple[list, list]]:
        """Per prompt: ([prompt + output ids per beam], [text per beam]), best first."""
        return self.generate(
            prompts,
            max_new_tokens=max_tokens,
            num_beams=beam_width,
            num_return_sequences=beam_width,
        )

    def encode(self, prompts: Sequence[str], *args: Any, **kwargs: Any) -> list[list[float]]:
        """sentence-transformers' embeddings of `prompts` (`is_sentence_transformer=True`),
        as vLLM's `HfRunner.encode`."""
        vectors = self.model.encode(list(prompts), *args, **kwargs)
        return [list(map(float, v)) for v in vectors]

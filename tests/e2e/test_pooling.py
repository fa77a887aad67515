"""Pooling models offline (`LLM.embed`, `classify`, `score`, `encode`) against
Transformers' own models and sentence-transformers on the same directories: a Qwen3
decoder converted to an embedder (last-token and mean pooling, chunked prompts,
Matryoshka dimensions, truncation), Qwen3ForSequenceClassification (3 labels) and
LlamaForSequenceClassification (1 label: a cross-encoder's scores), every norm weight
perturbed (`jvllm.testing.pooling_checkpoints`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jvllm import LLM, PoolingParams
from jvllm.pooling.offline import pair_token_ids
from jvllm.testing.pooling_checkpoints import (
    make_classifier,
    make_embedder,
    write_sentence_transformers,
)

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "rivers run to the sea",
    "a story about a small boat and a very long river that runs through the green valley "
    "past the old mill, the church and the market square where people sell bread",
    "hello",
]
# Small steps: the long text's prompt runs as several chunks.
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tokenizer_dir) -> Path:
    """A Qwen3 causal LM with a last-token sentence-transformers layout."""
    return make_embedder(tmp_path_factory.mktemp("embed") / "m", tokenizer_dir)


@pytest.fixture(scope="module")
def llm(embedder) -> LLM:
    return LLM(str(embedder), runner="pooling", **ENGINE)


def hf_hidden(path: Path, ids: list[int]) -> np.ndarray:
    """Transformers' final-norm hidden states `[n, H]` of one unpadded prompt."""
    from transformers import AutoModel

    model = _cached(AutoModel, path)
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy()


_MODELS: dict = {}


def _cached(cls, path: Path):
    key = (cls.__name__, str(path))
    if key not in _MODELS:
        _MODELS[key] = cls.from_pretrained(path).eval()
    return _MODELS[key]


def cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_embed_equals_transformers_last_token_and_sentence_transformers(llm, embedder):
    outs = llm.embed(TEXTS, use_tqdm=False)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embedder), device="cpu")
    for text, out in zip(TEXTS, outs, strict=True):
        ids = out.prompt_token_ids
        assert ids == llm.get_tokenizer().encode(text)
        got = np.array(out.outputs.embedding)
        assert abs(np.linalg.norm(got) - 1) < 1e-5  # the Normalize module
        assert cos(got, hf_hidden(embedder, ids)[-1]) >= 0.9999
        ref = st.encode([text], batch_size=1, normalize_embeddings=False)[0]
        assert cos(got, ref) >= 0.9999
    assert len(llm.llm_engine.requests) == 0
    # Every block is back: a finished pooling request keeps none but cached ones.
    usage = llm.get_metrics()["kv_cache_usage_perc"]
    assert usage == 0


def test_matryoshka_dimensions_and_truncation(llm, embedder):
    long_text = TEXTS[2]
    ids = llm.get_tokenizer().encode(long_text)
    out = llm.embed([long_text], pooling_params=PoolingParams(dimensions=32), use_tqdm=False)[0]
    want = hf_hidden(embedder, ids)[-1][:32]
    assert len(out.outputs.embedding) == 32
    np.testing.assert_allclose(out.outputs.embedding, want / np.linalg.norm(want), atol=2e-5)
    cut = llm.embed([long_text], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cos(cut.outputs.embedding, hf_hidden(embedder, ids[-5:])[-1]) >= 0.9999
    assert llm.get_metrics()["prefix_cache_hits"] > 0  # LAST pooling keeps prefix caching
    raw = llm.encode([long_text], PoolingParams(use_activation=False), use_tqdm=False)[0]
    np.testing.assert_allclose(raw.outputs.data, hf_hidden(embedder, ids)[-1], rtol=1e-4, atol=1e-4)


def test_bad_pooling_requests_name_the_problem(llm):
    with pytest.raises(ValueError, match="dimensions=24 is not supported"):
        llm.embed(["hello"], pooling_params=PoolingParams(dimensions=24), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.embed([list(range(5, 205))], use_tqdm=False)
    with pytest.raises(ValueError, match="'classify' is not served"):
        llm.encode(["hello"], PoolingParams(task="classify"), use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.classify needs a pooling model"):
        llm.classify(["hello"], use_tqdm=False)
    # The engine still serves after refusals.
    assert len(llm.embed(["hello"], use_tqdm=False)[0].outputs.embedding) == 64


def test_mean_pooling_from_the_sentence_transformers_layout(embedder, tmp_path):
    mean_dir = tmp_path / "mean"
    mean_dir.mkdir()
    for f in embedder.iterdir():
        if f.is_file() and f.name not in ("modules.json", "sentence_bert_config.json"):
            (mean_dir / f.name).symlink_to(f)
    write_sentence_transformers(mean_dir, 64, "mean_tokens")
    llm = LLM(str(mean_dir), runner="pooling", convert="embed", **ENGINE)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(mean_dir), device="cpu")
    texts = [*TEXTS[:3], TEXTS[2] + " and back home again"]  # two long prompts, chunked
    for out, text in zip(llm.embed(texts, use_tqdm=False), texts, strict=True):
        hidden = hf_hidden(embedder, out.prompt_token_ids).mean(axis=0)
        assert cos(out.outputs.embedding, hidden) >= 0.9999
        assert cos(out.outputs.embedding, st.encode([text], batch_size=1)[0]) >= 0.9999
    # MEAN reads every prompt token's row, which a prefix-cache hit would skip.
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching


def hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification

    model = _cached(AutoModelForSequenceClassification, path)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_qwen3_classifier_probs_equal_transformers(tmp_path, tokenizer_dir):
    path = make_classifier(tmp_path / "cls", tokenizer_dir, "qwen3", 3)
    llm = LLM(str(path), **ENGINE)  # runner "auto": a classifier pools
    outs = llm.classify(TEXTS, use_tqdm=False)
    for out in outs:
        logits = hf_logits(path, out.prompt_token_ids)
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(out.outputs.probs, probs, atol=1e-4)
        assert out.outputs.num_classes == 3
    raw = llm.encode(TEXTS[:2], PoolingParams(use_activation=False), use_tqdm=False)
    for out in raw:
        want = hf_logits(path, out.prompt_token_ids)
        np.testing.assert_allclose(out.outputs.data, want, atol=1e-4)
    with pytest.raises(ValueError, match="a score is one number"):
        llm.score("query", ["doc"], use_tqdm=False)


def test_llama_cross_encoder_scores_equal_transformers(tmp_path, tokenizer_dir):
    path = make_classifier(tmp_path / "rerank", tokenizer_dir, "llama", 1)
    llm = LLM(str(path), runner="pooling", **ENGINE)
    query, docs = "where do rivers run", TEXTS
    outs = llm.score(query, docs, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for doc, out in zip(docs, outs, strict=True):
        ids = pair_token_ids(tokenizer, query, doc)
        logit = hf_logits(path, ids)[0]
        assert abs(out.outputs.score - 1 / (1 + np.exp(-logit))) < 1e-4

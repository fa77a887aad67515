"""The pooling routes through the real Starlette app and engine thread, in process
(Starlette's TestClient is the httpx client the official `openai` client sends with):
`embeddings.create` in float and base64 against Transformers, Matryoshka dimensions,
`/pooling`, `/score`, `/rerank` and `/v1/rerank` (Jina's and Cohere's shapes) ordered
as Transformers' cross-encoder scores, and the 400s for bad input."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import torch
from starlette.testclient import TestClient

from jvllm.cli import parse_serve_args
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine_args import EngineArgs
from jvllm.pooling.offline import pair_token_ids
from jvllm.server.app import build_app
from jvllm.server.metrics import ServerMetrics
from jvllm.server.serving import ServingContext
from jvllm.testing.pooling_checkpoints import make_classifier, make_embedder

ENGINE = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
DOCS = [
    "rivers run to the sea",
    "the quick brown fox jumps over the lazy dog",
    "a small boat on a long river",
    "bread at the market",
    "hello",
]
QUERY = "where do rivers run"


def serve(path: Path, name: str, **kwargs) -> tuple[TestClient, str]:
    engine = EngineArgs(model=str(path), **ENGINE, **kwargs).create_engine()
    ctx = ServingContext(AsyncLLM(engine), [name], str(path))
    return TestClient(build_app(ctx, ServerMetrics())), name


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, tokenizer_dir):
    path = make_embedder(tmp_path_factory.mktemp("embed") / "m", tokenizer_dir)
    http, name = serve(path, "emb", runner="pooling")
    with http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        )
        yield SimpleNamespace(http=http, client=client, path=path, name=name)


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory, tokenizer_dir):
    path = make_classifier(tmp_path_factory.mktemp("rerank") / "m", tokenizer_dir, "qwen3", 1)
    http, name = serve(path, "rr")
    with http:
        yield SimpleNamespace(http=http, path=path, name=name)


def hf_last_hidden(path: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModel

    with torch.no_grad():
        model = AutoModel.from_pretrained(path).eval()
        return model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()


def test_openai_embeddings_float_and_base64_equal_transformers(embed_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embed_server.path)
    floats = embed_server.client.embeddings.create(
        model="emb", input=DOCS[:3], encoding_format="float"
    )
    # Without encoding_format the client asks for base64 and decodes it itself.
    b64 = embed_server.client.embeddings.create(model="emb", input=DOCS[:3])
    assert floats.usage.prompt_tokens == sum(len(tok.encode(d)) for d in DOCS[:3])
    for doc, f, b in zip(DOCS, floats.data, b64.data, strict=False):
        want = hf_last_hidden(embed_server.path, tok.encode(doc))
        got = np.array(f.embedding)
        assert got @ want / np.linalg.norm(want) >= 0.9999 and abs(np.linalg.norm(got) - 1) < 1e-5
        np.testing.assert_allclose(b.embedding, got, atol=1e-7)
    short = embed_server.client.embeddings.create(model="emb", input=[DOCS[0]], dimensions=16)
    head = np.array(floats.data[0].embedding[:16])  # Matryoshka: cut, then normalised
    np.testing.assert_allclose(short.data[0].embedding, head / np.linalg.norm(head), atol=1e-6)
    assert len(short.data[0].embedding) == 16 and floats.model == "emb"


def test_pooling_and_embedding_score_routes(embed_server):
    r = embed_server.http.post("/pooling", json={"model": "emb", "input": [[5, 6, 7], [8, 9]]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert data[0]["object"] == "pooling" and len(data[1]["data"]) == 64
    assert r.json()["usage"]["prompt_tokens"] == 5
    scored = embed_server.http.post("/score", json={"text_1": DOCS[0], "text_2": DOCS[:2]})
    assert scored.status_code == 200, scored.text
    values = [d["score"] for d in scored.json()["data"]]
    assert abs(values[0] - 1) < 1e-5 and values[1] < values[0]


@pytest.mark.parametrize(
    "path, body, problem",
    [
        ("/v1/embeddings", {"input": "w " * 100}, "max_model_len is 64"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 20}, "dimensions=20 is not supported"),
        ("/classify", {"input": "hi"}, "does not support the Classification API"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "not generation"),
        ("/v1/embeddings", {"input": []}, "input"),
    ],
)
def test_bad_pooling_requests_are_400s_naming_the_problem(embed_server, path, body, problem):
    r = embed_server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert problem in r.json()["error"]["message"]
    ok = embed_server.http.post("/v1/embeddings", json={"input": "still serving"})
    assert ok.status_code == 200


def test_rerank_orders_documents_as_transformers_scores(rerank_server):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rerank_server.path)
    model = AutoModelForSequenceClassification.from_pretrained(rerank_server.path).eval()
    with torch.no_grad():
        logits = [
            float(model(torch.tensor([pair_token_ids(tok, QUERY, d)])).logits[0, 0]) for d in DOCS
        ]
    order = sorted(range(len(DOCS)), key=lambda i: -logits[i])
    jina = {"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3}
    cohere = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False}
    routes = (("/rerank", jina, 3), ("/v1/rerank", cohere, 5), ("/v2/rerank", jina, 3))
    for path, body, top in routes:
        r = rerank_server.http.post(path, json=body)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:top]
        for x in results:
            assert abs(x["relevance_score"] - 1 / (1 + np.exp(-logits[x["index"]]))) < 1e-4
        assert ("document" in results[0]) == body.get("return_documents", True)
    score = rerank_server.http.post("/score", json={"queries": QUERY, "documents": DOCS[:2]})
    assert [round(d["score"], 4) for d in score.json()["data"]] == [
        round(1 / (1 + np.exp(-v)), 4) for v in logits[:2]
    ]
    classify = rerank_server.http.post("/classify", json={"input": DOCS[0]})
    assert classify.json()["data"][0]["num_classes"] == 1
    assert rerank_server.http.post("/v1/embeddings", json={"input": "x"}).status_code == 400


def test_serve_flags_reach_engine_args():
    config = '{"pooling_type": "MEAN"}'
    argv = ["m", "--runner", "pooling", "--convert", "embed", "--pooler-config", config]
    args = parse_serve_args(argv)
    assert (args.runner, args.convert, args.pooler_config) == (
        "pooling",
        "embed",
        {"pooling_type": "MEAN"},
    )

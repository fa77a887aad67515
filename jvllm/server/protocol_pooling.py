"""Request and response bodies of the pooling routes (vLLM's names and shapes).

Owns the accepted fields of `/v1/embeddings` (OpenAI's), `/pooling`, `/classify`,
`/score` (text_1/text_2, or queries/documents, data_1/data_2) and `/rerank` (Jina's and
Cohere's: documents as strings or `{"text": ...}` objects, `top_n`,
`return_documents`), and the bodies answered. Checks that need the model are the
pooling engine's; what the handlers do is `serving_pooling.py`'s.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from .protocol import Strict, TokenId

MAX_INPUTS = 2048  # texts in one request
Text = Annotated[str, Field(max_length=1 << 20)]
Inputs = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
TokenInputs = (
    Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class PoolingBasic(Strict):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    use_activation: bool | None = None


class EmbeddingRequest(PoolingBasic):
    input: Inputs | TokenInputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    add_special_tokens: bool = True


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "classify", "encode"] | None = None


class ClassificationRequest(PoolingBasic):
    input: Inputs | TokenInputs
    add_special_tokens: bool = True


class ScoreRequest(PoolingBasic):
    text_1: Inputs | None = None
    text_2: Inputs | None = None
    queries: Inputs | None = None
    documents: Inputs | None = None
    data_1: Inputs | None = None
    data_2: Inputs | None = None

    def sides(self) -> tuple[Inputs, Inputs]:
        """The two sides, whichever spelling the request used (exactly one)."""
        given = [
            (a, b)
            for a, b in (
                (self.text_1, self.text_2),
                (self.queries, self.documents),
                (self.data_1, self.data_2),
            )
            if a is not None or b is not None
        ]
        if len(given) != 1 or given[0][0] is None or given[0][1] is None:
            raise ValueError(
                "give the two sides as text_1 and text_2 (or queries and documents, or "
                "data_1 and data_2), exactly one pair"
            )
        return given[0]  # type: ignore[return-value]


class RerankDocumentIn(Strict):
    text: Text


class RerankRequest(PoolingBasic):
    query: Text
    documents: Annotated[list[Text | RerankDocumentIn], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: Annotated[int, Field(ge=0)] = 0  # 0: every document
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


# -- responses --


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]

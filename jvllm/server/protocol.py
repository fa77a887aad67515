"""Request bodies of the OpenAI-compatible API, as strict pydantic models, and their caps.

Owns the shape and range of every accepted field (OpenAI's names, plus vLLM's
sampling extras) and the limits that keep one request from hogging the server.
Checks that need the model (vocabulary, context length) are the engine's
(`jvllm.engine.validation`); the
response bodies are in `responses.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jvllm.sampling_params import MAX_LOGPROBS

MAX_N = 16  # sequences per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_ALLOWED_TOKEN_IDS = 1 << 17
MAX_BAD_WORDS = 128
MAX_TOOLS = 128
MAX_MESSAGES = 512
MAX_BODY_BYTES = 4 << 20

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class Strict(BaseModel):
    # strict: "5" is not an int and true is not a number; NaN and inf are refused.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class StructuredOutputsRequest(Strict):
    """vLLM's extra-body `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, max_length=1024)
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(Strict):
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Request fields older vLLM versions took, refused by name with what replaced them.
LEGACY_GUIDED = {
    "guided_json": "structured_outputs.json (or response_format json_schema)",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": "nothing: llguidance compiles every constraint",
    "guided_whitespace_pattern": "nothing: JSON is generated without free whitespace",
}


class SamplingRequest(Strict):
    """Fields that completions and chat share."""

    model: str | None = Field(None, description="A served model name; defaults to the first")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = Field(
        None, description="A stop string or a list of them"
    )
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = Field(None, max_length=256)
    # vLLM's sampling extras.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[TokenId] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # vLLM's beam search extras: n beams, Transformers' length penalty.
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    # vLLM's scheduling extra: with --scheduling-policy priority, lower runs first.
    priority: Int64 = 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[int], Field(max_length=MAX_BODY_BYTES)]
PromptInput = (
    Annotated[str, Field(max_length=MAX_BODY_BYTES)]
    | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)]
)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: PromptInput = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists"
    )
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str  # a data: URL, or http(s) from --allowed-media-domains
    detail: str | None = None


class ImageURLPart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCallIn(Strict):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCallIn(Strict):
    """A call an assistant message made, sent back in a later request."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart | ImageURLPart] | None = Field(
        None, description="A string or a list of text and image_url parts"
    )
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            isinstance(part, ImageURLPart) for part in self.content
        )


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (enable_thinking, ...)"
    )


class TokenizeRequest(Strict):
    """POST /tokenize: `prompt`, or `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_BODY_BYTES)
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_BODY_BYTES)

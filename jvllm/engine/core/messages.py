"""The messages between the front end and an engine core (vLLM's `EngineCoreRequest`,
`EngineCoreOutputs` and utility calls), as msgspec Structs over msgpack: no pickle
crosses the socket, and each side decodes into declared types only.

Owns the wire shapes and their codecs. A core first sends each front end its
`EngineCoreInfo` (once it connected); then a front end sends one message and reads one
reply (`Hello` -> `EngineCoreInfo`, `AddRequest` -> `AddReply`, `Step` -> `StepReply`,
`UtilityCall` -> `UtilityReply`, `Abort` -> `UtilityReply` with the metrics after it,
so that freed blocks show at once); `Shutdown` has no reply. `EngineLoad` and
`LoadTable` go to and from the DP coordinator (`coordinator.py`). Not owned:
the loop that serves them (`core.py`) or the client that sends them (`client.py`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from jvllm.lora.request import LoRARequest
from jvllm.outputs import CompletionOutput, PositionLogprobs
from jvllm.sampling_params import BeamSearchParams, SamplingParams


class Hello(msgspec.Struct, tag="hello"):
    pass


class AddRequest(msgspec.Struct, tag="add"):
    """A tokenized request; the core reports its outputs as deltas (`output_kind`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    sampling_params: SamplingParams | None = None
    beam_search_params: BeamSearchParams | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None


class Abort(msgspec.Struct, tag="abort"):
    """Ends requests, or (`choices`) some sequences of a request: n > 1 choices that a
    stop string ended in the front end while the others go on."""

    request_ids: list[str]
    choices: dict[str, list[int]] = {}


class Step(msgspec.Struct, tag="step"):
    """Run a step (unless one ran ahead) and send my outputs; `prefetch`: then run the
    next step at once, while the front end handles these outputs."""

    prefetch: bool = False


class UtilityCall(msgspec.Struct, tag="utility"):
    """vLLM's `call_utility`: a named engine method (`core.UTILITIES`) and its arguments."""

    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


Request = Hello | AddRequest | Abort | Step | UtilityCall | Shutdown


class EngineCoreInfo(msgspec.Struct):
    """What a front end needs to know of the engine without building it."""

    engine_index: int
    pid: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    supported_tasks: list[str]
    lora_enabled: bool
    scheduling_policy: str
    cache_config: dict[str, Any]
    metrics: dict[str, Any]
    hostname: str = ""  # the host it runs on (names a core on another host)


class AddReply(msgspec.Struct):
    error: str | None = None
    param: str | None = None  # the request field the error names (InvalidRequestError)
    error_type: str = "ValueError"
    num_added: int = 0  # the requests the core has taken, this one included


class EngineLoad(msgspec.Struct, array_like=True):
    """One core's load, as it pushes it to the DP coordinator when it changes."""

    engine_index: int
    waiting: int  # sequences (a request's n choices count n), as the scheduler holds them
    running: int  # sequences
    num_added: int  # requests (not sequences) it has taken so far (`AddReply.num_added`)


class LoadTable(msgspec.Struct, array_like=True):
    """Every core's latest load, as the DP coordinator publishes it (None: not heard)."""

    engines: list[EngineLoad | None]


class WireOutput(msgspec.Struct, array_like=True):
    """One request's progress in one step, as a delta (new tokens and text only)."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0


class StepReply(msgspec.Struct):
    outputs: list[WireOutput]
    metrics: dict[str, Any]  # the engine's get_metrics() after the step


class UtilityReply(msgspec.Struct):
    result: Any = None
    error: str | None = None
    error_type: str | None = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    return _request_decoder.decode(data)


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    """A decoder of one reply type."""
    return msgspec.msgpack.Decoder(kind)

"""What `LLM.beam_search` returns: BeamSearchOutput and BeamSearchSequence (vLLM's shapes).

As vLLM's: `tokens` holds the prompt followed by the generated tokens, `text` the
generated text alone (an EOS token that ended the beam is not decoded unless
`include_stop_str_in_output`). `score` is Transformers' `sequences_scores`: the
cumulative log-probability divided by `len(generated) ** length_penalty`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jvllm.outputs import PositionLogprobs


@dataclass
class BeamSearchSequence:
    tokens: list[int]
    logprobs: list[PositionLogprobs]  # per generated position: its candidates, chosen first
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first

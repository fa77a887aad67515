"""The sampler: one step's logits to token ids and logprobs, on device.

`metadata` (the per-row arrays and how the host fills them), `sampling` (`sample`:
penalties, biases and bans, greedy and seeded draws, logprobs, grouped rows on CPU),
`top_k_top_p` (which logits stay candidates), `rejection` (draft tokens), `draws`
(the draws they share). Does not own resolving a request's seed (the engine), choosing
the bucket sizes S and P or moving the arrays to the device (the runner), or slicing
the top logprobs down to what each request asked for (the engine).

Every sampling knob is an array, never a static argument: new temperatures or seeds
reuse the compiled program; only the shapes S, V, E and F select one.
"""

from jvllm.layers.sampler.draws import argmax_rows, blocked_race, inverse_cdf_draw
from jvllm.layers.sampler.metadata import (
    MIN_BIAS_ENTRIES,
    MIN_PENALTY_ENTRIES,
    SamplingMetadata,
    bias_entries_needed,
    make_sampling_metadata,
    penalty_entries_needed,
)
from jvllm.layers.sampler.rejection import rejection_sample, target_probs
from jvllm.layers.sampler.sampling import (
    GROUP_ROWS_CPU,
    SamplerOutput,
    apply_penalties,
    apply_token_bitmask,
    over_groups,
    sample,
)
from jvllm.layers.sampler.top_k_top_p import TOP_CANDIDATES, filter_logits

__all__ = [
    "GROUP_ROWS_CPU",
    "MIN_BIAS_ENTRIES",
    "MIN_PENALTY_ENTRIES",
    "TOP_CANDIDATES",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_penalties",
    "apply_token_bitmask",
    "argmax_rows",
    "bias_entries_needed",
    "blocked_race",
    "filter_logits",
    "inverse_cdf_draw",
    "make_sampling_metadata",
    "over_groups",
    "penalty_entries_needed",
    "rejection_sample",
    "sample",
    "target_probs",
]

"""Rope scalings against Transformers' own rope functions and rotary embedding module.

Each case builds a Transformers config, reads its rope parameters back through
`rope_from_config(config.to_dict())` (what the loader does with config.json), and
compares the inverse frequencies and the cos/sin scaling with
`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` at sequence lengths inside and
past the original window; then the cos/sin of whole sequences with
`LlamaRotaryEmbedding`, whose forward recomputes length-dependent frequencies itself.
Tolerance: float32 rounding (numpy's and torch's float32 powers differ by an ulp in a few
frequencies; cos/sin by a few ulp of the angle).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jvllm.layers import rotary
from jvllm.models.spec import RopeSpec, rope_from_config

HEAD_DIM = 64
_rng = np.random.default_rng(0)
SHORT = [float(x) for x in 1 + _rng.random(HEAD_DIM // 2)]
LONG = [float(x) for x in 1 + 8 * _rng.random(HEAD_DIM // 2)]

# (name, config class, max_position_embeddings, rope parameters, extra config fields)
CASES = [
    ("linear", LlamaConfig, 512, dict(rope_type="linear", factor=4.0), {}),
    (
        "llama3",
        LlamaConfig,
        2048,
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
        {},
    ),
    ("dynamic", LlamaConfig, 256, dict(rope_type="dynamic", factor=2.0), {}),
    ("dynamic-f8", LlamaConfig, 128, dict(rope_type="dynamic", factor=8.0), {}),
    (
        "yarn",
        LlamaConfig,
        1024,
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
        {},
    ),
    (
        "yarn-no-truncate-betas",
        LlamaConfig,
        1024,
        dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=256,
            truncate=False,
            beta_fast=16.0,
            beta_slow=2.0,
        ),
        {},
    ),
    (
        "yarn-mscale-deepseek",
        LlamaConfig,
        4096,
        dict(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=128,
            mscale=0.707,
            mscale_all_dim=1.0,
        ),
        {},
    ),
    (
        "yarn-attention-factor",
        LlamaConfig,
        1024,
        dict(
            rope_type="yarn",
            factor=8.0,
            original_max_position_embeddings=128,
            attention_factor=1.25,
        ),
        {},
    ),
    (
        "longrope",
        LlamaConfig,
        1024,
        dict(
            rope_type="longrope",
            short_factor=SHORT,
            long_factor=LONG,
            factor=4.0,
            original_max_position_embeddings=256,
        ),
        {},
    ),
    (
        # Phi-3 keeps original_max_position_embeddings outside the rope dict and no factor.
        "longrope-phi3",
        Phi3Config,
        1024,
        dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG),
        dict(original_max_position_embeddings=128),
    ),
]


def _config(cls, max_pos: int, params: dict, extra: dict):
    return cls(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_pos,
        rope_parameters={**params, "rope_theta": 10000.0},
        **extra,
    )


@pytest.mark.parametrize("name,cls,max_pos,params,extra", CASES, ids=[c[0] for c in CASES])
def test_frequencies_and_scaling_equal_transformers(name, cls, max_pos, params, extra):
    config = _config(cls, max_pos, params, extra)
    rope = rope_from_config(config.to_dict())
    assert rope.rope_type == params["rope_type"]
    fn = ROPE_INIT_FUNCTIONS[rope.rope_type]
    original = rope.original_max_position_embeddings
    for seq_len in (None, 1, original, original + 1, max_pos, 3 * max_pos + 5):
        want, want_scaling = fn(config, "cpu", seq_len=seq_len)
        got = rotary.inverse_frequencies(rope, HEAD_DIM, seq_len)
        assert got.dtype == np.float32 and got.shape == (HEAD_DIM // 2,)
        np.testing.assert_allclose(got, want.numpy(), rtol=2e-6, err_msg=f"seq_len={seq_len}")
        assert rotary.attention_scaling(rope) == pytest.approx(want_scaling, rel=1e-12)
    scale = HEAD_DIM**-0.5
    want_scale = yarn_apply_mscale(config.rope_parameters, scale)
    assert rotary.yarn_softmax_scale(rope, scale) == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("name,cls,max_pos,params,extra", CASES, ids=[c[0] for c in CASES])
def test_cos_sin_equal_the_transformers_module_past_the_window(name, cls, max_pos, params, extra):
    """Whole sequences, each one forward of a fresh module (dynamic rope is stateful)."""
    config = _config(LlamaConfig, max_pos, params, {})
    if extra:  # LlamaConfig has no top-level original_max_position_embeddings
        config.rope_parameters["original_max_position_embeddings"] = extra[
            "original_max_position_embeddings"
        ]
    rope = rope_from_config(config.to_dict())
    for length in (rope.original_max_position_embeddings // 2, max_pos, 2 * max_pos + 3):
        module = LlamaRotaryEmbedding(config)
        positions = torch.arange(length)[None, :]
        want_cos, want_sin = module(torch.zeros(1, dtype=torch.float32), positions)
        lens = jnp.full((length,), length, jnp.int32)
        cos, sin = rotary.rope_cos_sin(
            rope, HEAD_DIM, jnp.arange(length), jnp.float32, rope_lens=lens
        )
        # Angles reach ~length radians in float32 (an ulp of the angle grows with it), and
        # XLA's and torch's cos reduce large arguments differently: a few ulp of the angle.
        limit = 8 * np.finfo(np.float32).eps * np.arange(length)[:, None] + 2e-6
        assert (np.abs(np.asarray(cos) - want_cos[0].numpy()) <= limit).all()
        assert (np.abs(np.asarray(sin) - want_sin[0].numpy()) <= limit).all()


def test_dynamic_and_longrope_take_each_tokens_own_length():
    """A ragged batch: a short row keeps the original frequencies while a long one scales."""
    for rope in (
        RopeSpec(theta=1e4, rope_type="dynamic", factor=4.0, max_position_embeddings=64),
        RopeSpec(
            theta=1e4,
            rope_type="longrope",
            original_max_position_embeddings=64,
            factor=4.0,
            short_factor=tuple(SHORT),
            long_factor=tuple(LONG),
        ),
    ):
        positions = jnp.array([10, 10, 200], jnp.int32)
        lens = jnp.array([20, 201, 201], jnp.int32)
        cos, _ = rotary.rope_cos_sin(rope, HEAD_DIM, positions, jnp.float32, rope_lens=lens)
        scaling = rotary.attention_scaling(rope)
        for row, seq_len in enumerate((20, 201, 201)):
            inv = rotary.inverse_frequencies(rope, HEAD_DIM, seq_len)
            angles = np.concatenate([inv, inv]) * float(positions[row])
            np.testing.assert_allclose(
                np.asarray(cos[row]), np.cos(angles) * scaling, atol=2e-5, err_msg=rope.rope_type
            )
        assert not np.allclose(np.asarray(cos[0]), np.asarray(cos[1]))
        # numpy integers (a length read from an array) are lengths like any other
        for seq_len in (20, 201):
            np.testing.assert_array_equal(
                rotary.inverse_frequencies(rope, HEAD_DIM, np.int32(seq_len)),
                rotary.inverse_frequencies(rope, HEAD_DIM, seq_len),
            )
        with pytest.raises(ValueError, match="rope_lens"):
            rotary.rope_cos_sin(rope, HEAD_DIM, positions, jnp.float32)


def _raw(rope_parameters: dict, **top) -> dict:
    return {"max_position_embeddings": 1024, "rope_parameters": rope_parameters, **top}


@pytest.mark.parametrize(
    "cfg,match",
    [
        (_raw({"rope_type": "ntk-by-parts", "factor": 2.0}), "rope scaling type 'ntk-by-parts'"),
        (_raw({"rope_type": "yarn", "factor": 0.5}), "factor must be >= 1, got 0.5"),
        (_raw({"rope_type": "dynamic", "factor": 0.0}), "factor must be >= 1"),
        (
            _raw({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 8.0}),
            r"beta_fast \(1.0\) must be >= beta_slow \(8.0\)",
        ),
        (
            _raw({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}),
            "attention_factor must be > 0",
        ),
        (_raw({"rope_type": "longrope", "long_factor": LONG}), "short_factor must be a non-empty"),
        (
            _raw({"rope_type": "longrope", "short_factor": 2.0, "long_factor": LONG}),
            "short_factor must be a list",
        ),
        (
            _raw({"rope_type": "longrope", "short_factor": [1.0, -1.0], "long_factor": [1, 1]}),
            "short_factor must be a non-empty list of positive numbers",
        ),
        (
            _raw(
                {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                }
            ),
            r"high_freq_factor \(1.0\) must be greater than low_freq_factor \(4.0\)",
        ),
        (_raw({"rope_type": "default", "rope_theta": -1.0}), "rope_theta must be > 0"),
    ],
)
def test_bad_configs_are_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        rope_from_config(cfg)


def test_longrope_factors_must_fit_the_head_dim():
    rope = rope_from_config(
        _raw({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    )
    with pytest.raises(ValueError, match="short_factor has 8 values; head_dim 64 needs 32"):
        rotary.inverse_frequencies(rope, 64)
    with pytest.raises(ValueError, match="long_factor has 8 values"):
        rotary.inverse_frequencies(rope, 64, seq_len=5000)


def test_legacy_rope_scaling_spelling_and_defaults():
    """transformers < 5 configs: `rope_scaling` with `type`; missing lengths default to
    max_position_embeddings (factor to their ratio for yarn), as Transformers fills them."""
    cfg = {
        "max_position_embeddings": 4096,
        "rope_theta": 5e5,
        "original_max_position_embeddings": 1024,
        "rope_scaling": {"type": "yarn"},
    }
    rope = rope_from_config(cfg)
    assert (rope.rope_type, rope.theta, rope.factor) == ("yarn", 5e5, 4.0)
    assert rope.original_max_position_embeddings == 1024
    assert dataclasses.replace(rope, truncate=False).truncate is False
    plain = rope_from_config({"max_position_embeddings": 300})
    assert (plain.rope_type, plain.theta, plain.original_max_position_embeddings) == (
        "default",
        10000.0,
        300,
    )


def test_per_layer_type_rope_parameters():
    """Gemma 3 nests one rope dict per layer type: each equals Transformers' for its type."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        head_dim=HEAD_DIM,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    cfg = config.to_dict()
    for layer_type, theta in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        rope = rope_from_config(cfg, layer_type)
        assert rope.theta == theta
        fn = ROPE_INIT_FUNCTIONS.get(rope.rope_type)
        if fn is None:  # "default" has no entry: the module computes it itself
            want = 1.0 / theta ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM)
        else:
            want = fn(config, "cpu", layer_type=layer_type)[0].numpy()
        np.testing.assert_allclose(rotary.inverse_frequencies(rope, HEAD_DIM), want, rtol=2e-6)
    with pytest.raises(ValueError, match=r"per layer type \['full_attention', 'sliding"):
        rope_from_config(cfg)

"""Quantized mixture-of-experts checkpoints against Transformers on their dequantized
weights: logits, greedy tokens on 12 prompts, and on TP=2 or EP=2 as well.

The checkpoints are made by llm-compressor itself from the tiny Qwen3-MoE (8 experts,
top-3, a dense layer between sparse ones) and Mixtral (4 experts, top-2): int8 per output
channel (W8A16, pack-quantized), int4 by groups of 16 inputs (W4A16, pack-quantized;
the experts dequantized at load), float8 weights with one scale per tensor (each expert's
own), and float8 per output channel; llm-compressor linearises the experts and leaves the
routers in float. The reference is Transformers' float model of the weights
compressed-tensors dequantizes (`moe_quantized_reference.py`). Also `quantization="int8"`
/ `"fp8"` at load on a float MoE checkpoint, and the schemes experts refuse.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jvllm import LLM, SamplingParams
from jvllm.models.loader import load_model
from tests.helpers import hf_greedy, require_installed
from tests.models.test_forward import assert_close, hf_logits
from tests.models.test_quantization import dequantized_copy, prompt_row

pytest.importorskip("compressed_tensors")
require_installed("llmcompressor")

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 8
ENGINE = dict(max_model_len=256, max_num_seqs=12, max_num_batched_tokens=64)
# (architecture, llm-compressor recipe in MOE_RECIPES)
CASES = [
    ("qwen3_moe", "w8a16-channel"),
    ("qwen3_moe", "w4a16-g16"),
    ("qwen3_moe", "fp8-weights-tensor"),
    ("mixtral", "fp8-weights-channel"),
]
# FP8 W8A8 (float8 weights per channel, dynamic per-token float8 inputs): its reference
# is compressed-tensors running the checkpoint itself, in a process of its own.
W8A8 = ("qwen3_moe", "fp8-dynamic")
_PRODUCE = """
import sys
from pathlib import Path
from tests.models.llmcompressor_checkpoints import produce
for arch, recipe in {cases}:
    produce(Path(sys.argv[1]) / arch, Path(sys.argv[2]) / arch, [recipe], 512)
"""


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in range(3, 123, 10)]


@pytest.fixture(scope="module")
def made(moe_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case's checkpoint, by llm-compressor in one subprocess."""
    src = next(iter(moe_checkpoints.values())).parent
    root = tmp_path_factory.mktemp("moe-llmcompressor")
    cases = [*CASES, W8A8]
    cmd = [sys.executable, "-c", _PRODUCE.format(cases=cases), str(src), str(root)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return root


@pytest.fixture(scope="module", params=CASES, ids=["/".join(c) for c in CASES])
def case(request: pytest.FixtureRequest, made: Path) -> Path:
    arch, recipe = request.param
    return made / arch / recipe


@pytest.fixture(scope="module")
def reference(case: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, Any]:
    from transformers import AutoModelForCausalLM

    from tests.models.moe_quantized_reference import write_dequantized

    floats = write_dequantized(case, tmp_path_factory.mktemp("dequantized") / case.name)
    hf = AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    return LLM(str(case), **ENGINE), hf


def test_experts_load_quantized_as_llmcompressor_wrote_them(reference, case: Path) -> None:
    config = json.loads((case / "config.json").read_text())["quantization_config"]
    assert "lm_head" in config["ignore"] and any(i.endswith(".gate") for i in config["ignore"])
    llm, _ = reference
    params = llm.engine.runner.model.params
    layer = next(p for k, p in params["model"].items() if "mlp" in p and "experts" in p["mlp"])
    experts = layer["mlp"]["experts"]
    if "w4a16" in case.name:  # dequantized at load: float experts, no scales
        assert experts["gate_proj"].dtype == jnp.float32
        assert not any(k.endswith("_scale") for k in experts)
        return
    want = jnp.int8 if "w8a16" in case.name else jnp.float8_e4m3fn
    e, i, h = experts["gate_proj"].shape
    assert experts["gate_proj"].dtype == want and experts["down_proj"].dtype == want
    per_tensor = case.name.endswith("tensor")
    assert experts["gate_proj_scale"].shape == (e, 1 if per_tensor else i)
    assert experts["down_proj_scale"].shape == (e, 1 if per_tensor else h)


def test_logits_match_transformers(reference, moe_checkpoints, case: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm, hf = reference
    ids = prompts()[6]
    (got,) = llm.engine.runner.forward_logits([prompt_row(ids)], every_token=True)
    want = hf_logits(hf, ids)
    assert_close(got, want)
    # The quantization shows: the float checkpoint's logits are further off than that.
    float_hf = AutoModelForCausalLM.from_pretrained(moe_checkpoints[case.parent.name]).eval()
    assert np.abs(hf_logits(float_hf, ids) - want).max() > 1e-2


def test_greedy_tokens_equal_transformers(reference) -> None:
    llm, hf = reference
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    for ids, out in zip(prompts(), outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, ids, NEW_TOKENS, eos)


# Each case on two devices: int8 per-channel scales split with gate/up's outputs (TP),
# the dequantized int4 experts split like float ones (TP),
# per-tensor float8 scales and per-channel ones split with the experts (EP).
TWO_DEVICES = {
    "w8a16-channel": False,
    "w4a16-g16": False,
    "fp8-weights-tensor": True,
    "fp8-weights-channel": True,
}


def test_two_devices_equal_transformers(reference, case: Path) -> None:
    """TP=2 (or EP=2) greedy tokens equal Transformers', as one device's do above."""
    _, hf = reference
    expert_parallel = TWO_DEVICES[case.name]
    llm = LLM(str(case), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    batch = prompts()[:6]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for ids, out in zip(batch, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, ids, NEW_TOKENS, eos)


def test_quantization_at_load_matches_the_dequantized_model(
    moe_checkpoints, tmp_path: Path
) -> None:
    """quantization='int8' on a float Qwen3-MoE checkpoint: each expert's weight per output
    channel, as dense layers are ('fp8' takes the same path with float8 storage); logits
    and greedy tokens equal Transformers on the dequantized weights."""
    quantization = "int8"
    from transformers import AutoModelForCausalLM

    src = moe_checkpoints["qwen3_moe"]
    floats = dequantized_copy(src, tmp_path / "deq", quantization)
    hf = AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    llm = LLM(str(src), quantization=quantization, **ENGINE)
    ids = prompts()[4]
    (got,) = llm.engine.runner.forward_logits([prompt_row(ids)], every_token=True)
    assert_close(got, hf_logits(hf, ids))
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[:6]], params, use_tqdm=False)
    for ids, out in zip(prompts(), outs, strict=False):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, ids, NEW_TOKENS, eos)


def test_unsupported_expert_schemes_are_named(made: Path, tmp_path: Path) -> None:
    """A scheme with zero points (asymmetric 4-bit groups) on experts fails at load,
    naming the scheme and what experts accept."""
    src = made / "qwen3_moe" / "w8a16-channel"
    dst = tmp_path / "w4"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (group,) = config["quantization_config"]["config_groups"].values()
    group["weights"].update(num_bits=4, strategy="group", group_size=32, symmetric=False)
    (dst / "config.json").write_text(json.dumps(config))
    named = "quantized experts in the scheme .*bits=4.*zero_points=True.*supported"
    with pytest.raises(ValueError, match=named):
        load_model(dst)


_W8A8_REFERENCE = """
import json, sys
from pathlib import Path
from tests.models.moe_quantized_reference import write_compressed_tensors_outputs
args = json.loads(sys.argv[1])
write_compressed_tensors_outputs(Path(args["src"]), args["prompts"], args["new"],
                                 args["eos"], Path(args["dst"]))
"""


@pytest.fixture(scope="module")
def w8a8(made: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, LLM]:
    """The FP8_DYNAMIC checkpoint, compressed-tensors' outputs on it and jvllm on it."""
    src = made / W8A8[0] / W8A8[1]
    llm = LLM(str(src), **ENGINE)
    dst = tmp_path_factory.mktemp("w8a8") / "reference.json"
    args = dict(src=str(src), prompts=[prompts()[6], *prompts()], new=NEW_TOKENS, dst=str(dst))
    args["eos"] = llm.get_tokenizer().eos_token_id
    cmd = [sys.executable, "-c", _W8A8_REFERENCE, json.dumps(args)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return src, json.loads(dst.read_text()), llm


def test_fp8_dynamic_experts_match_compressed_tensors(w8a8) -> None:
    """float8 experts with per-token float8 inputs: logits within float32 tolerance (but
    where a float8 rounding flips) and greedy tokens on 12 prompts (all but at most one)
    equal compressed-tensors' run of the checkpoint; float inputs (the weights alone)
    are further off."""
    from transformers import AutoModelForCausalLM

    from tests.models.moe_quantized_reference import write_dequantized

    src, ref, llm = w8a8
    params = llm.engine.runner.model.params["model"]
    layer = next(p for p in params.values() if "mlp" in p and "experts" in p["mlp"])
    assert layer["mlp"]["experts"]["down_proj"].dtype == jnp.float8_e4m3fn
    ids = prompts()[6]
    (got,) = llm.engine.runner.forward_logits([prompt_row(ids)], every_token=True)
    want = np.asarray(ref["logits"], np.float32)  # [T, V]
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    # A value that float32 noise puts on the other side of a float8 rounding midpoint
    # moves its own token's logits alone (seen: 2 of these 63 positions, the others
    # within 2e-6); nine in ten positions must be within float32 tolerance.
    assert (np.abs(got - want).max(axis=-1) <= tol).mean() >= 0.9
    floats = write_dequantized(src, src.parent / "fp8-dynamic-weights-only")
    weights_only = AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    assert (np.abs(hf_logits(weights_only, ids) - want).max(axis=-1) > 1e-2).mean() > 0.5
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    got_tokens = [list(o.outputs[0].token_ids) for o in outs]
    # Such a flip can also decide a near-tie between two tokens: seen once in 96 steps
    # (prompt 8, step 6: 310 against 13); every other prompt is equal throughout.
    equal = [g == w for g, w in zip(got_tokens, ref["greedy"][1:], strict=True)]
    assert sum(equal) >= len(equal) - 1, equal


def test_fp8_dynamic_experts_expert_parallel_and_tp_refused(w8a8) -> None:
    """EP=2 keeps one device's greedy tokens; TP=2 without EP, which would split a
    token's down_proj input over devices (and with it its float8 scale), is refused."""
    src, ref, _ = w8a8
    llm = LLM(str(src), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    batch = prompts()[:6]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == ref["greedy"][1:7]
    with pytest.raises(ValueError, match="FP8_DYNAMIC.*tensor_parallel_size=2.*expert_par"):
        LLM(str(src), tensor_parallel_size=2, **ENGINE)

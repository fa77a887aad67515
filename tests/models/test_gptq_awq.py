"""GPTQ and AWQ checkpoints against Transformers running the weights compressed-tensors
dequantizes from its checkpoint of the same integers: logits, greedy tokens on 12
prompts, TP=2 equal to TP=1, weight bytes, and the errors bad files and configs get.

The GPTQ and AWQ files are laid out from compressed-tensors' integers (see
`legacy_checkpoints.py`; no GPTQ or AWQ writer installs here); compressed-tensors' own
AWQ reader turns the AWQ layout back into the same integers. jvllm also reads the
compressed-tensors checkpoint itself, zero points included.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from jvllm import LLM
from jvllm.models.loader import load_model
from jvllm.parallel.mesh import AXIS, make_mesh
from tests.models.test_compressed_tensors import (
    ENGINE,
    check_greedy,
    check_logits,
    check_tensor_parallel,
    compress,
    prompts,
)
from tests.models.test_forward import assert_close, hf_logits
from tests.models.test_quantization import linear_bytes, prompt_row

ct = pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file, save_file  # noqa: E402

from tests.models.legacy_checkpoints import (  # noqa: E402
    awq_pack,
    ct_args,
    set_dequantized_weights,
    write_legacy,
)

# name -> (layout, bits, group size or None per channel, symmetric, activation order)
CASES = {
    "gptq-w4g32-asym-desc_act": ("gptq", 4, 32, False, True),
    "gptq-w8-channel-sym": ("gptq", 8, None, True, False),
    "awq-w4g32": ("awq", 4, 32, False, False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case_dirs(request, checkpoints, tmp_path_factory):
    """(GPTQ or AWQ checkpoint, the compressed-tensors checkpoint of the same integers,
    the case)."""
    case = CASES[request.param]
    root = tmp_path_factory.mktemp("legacy")
    args = ct_args(case)
    spec = (args.num_bits, args.strategy, args.group_size, args.symmetric)
    ct_dir = compress(checkpoints["llama"], root / "ct", spec)
    write_legacy(ct_dir, root / request.param, case)
    return root / request.param, ct_dir, case


@pytest.fixture(scope="module")
def reference(case_dirs, checkpoints):
    """(jvllm on the legacy checkpoint, Transformers on the float model whose linear
    weights compressed-tensors dequantized from its checkpoint). Transformers 5.24 does
    not load an asymmetric pack-quantized checkpoint itself (its zero points stay
    packed, a size mismatch), so the reference is the dequantized float model."""
    from transformers import AutoModelForCausalLM

    legacy, ct_dir, case = case_dirs
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32).eval()
    set_dequantized_weights(hf, ct_dir, ct_args(case))
    return LLM(str(legacy), **ENGINE), hf


def test_logits_match_transformers_on_the_same_integers(reference) -> None:
    check_logits(*reference)


def test_greedy_generate_matches_transformers(reference) -> None:
    check_greedy(*reference)


def test_tensor_parallel_equals_one_device(reference, case_dirs) -> None:
    check_tensor_parallel(reference[0], case_dirs[0])


def test_compressed_tensors_checkpoint_of_the_same_integers_matches_too(reference, case_dirs):
    """jvllm reads the compressed-tensors source itself, zero points included."""
    _, hf = reference
    ids = prompts()[6]
    llm = LLM(str(case_dirs[1]), **ENGINE)
    (got,) = llm.engine.runner.forward_logits([prompt_row(ids)], every_token=True)
    assert_close(got, hf_logits(hf, ids))


def test_awq_writer_agrees_with_compressed_tensors_reader() -> None:
    """compressed-tensors' AutoAWQ converter reads this module's AWQ packing back to the
    integers it was written from."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    rng = np.random.default_rng(1)
    q, zero = rng.integers(-8, 8, size=(64, 96)), rng.integers(-8, 8, size=(64, 3))
    scale = rng.random((64, 3)).astype(np.float32)
    tensors = {
        "l.qweight": awq_pack((q + 8).T),
        "l.qzeros": awq_pack((zero + 8).T),
        "l.scales": np.ascontiguousarray(scale.T),
    }
    back = AutoAWQConverter(group_size=32).process(
        {k: torch.from_numpy(v) for k, v in tensors.items()}
    )
    q8, zero8 = torch.from_numpy(q).to(torch.int8), torch.from_numpy(zero).to(torch.int8)
    assert torch.equal(back["l.weight_packed"], pack_to_int32(q8, 4))
    assert torch.equal(back["l.weight_zero_point"], pack_to_int32(zero8, 4, packed_dim=0))
    assert torch.equal(back["l.weight_scale"], torch.from_numpy(scale))


def rewrite(src, dst, config_change=None, tensor_change=None):
    """A copy of checkpoint `src` with its quantization_config updated and one tensor
    replaced (None: removed)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] |= config_change or {}
    (dst / "config.json").write_text(json.dumps(config))
    if tensor_change:
        tensors = load_file(str(dst / "model.safetensors"))
        name, value = tensor_change
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value.contiguous()
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_bad_configs_and_tensors_are_refused(case_dirs, tmp_path) -> None:
    legacy, _, (layout, bits, group_size, _, desc) = case_dirs
    layer = "model.layers.1.self_attn.o_proj"
    tensors = load_file(str(legacy / "model.safetensors"))
    cases = [
        ({"bits": 3}, None, r"bits=3 .*not supported; supported: "),
        ({"group_size": 24}, None, "not a multiple of the group size 24"),
        (
            None,
            (f"{layer}.scales", tensors[f"{layer}.scales"][:, :8]),
            r"'\S+o_proj.scales' has shape",
        ),
        (None, (f"{layer}.qweight", None), r"no tensor '\S+o_proj.qweight' \(shape"),
    ]
    if layout == "awq":
        cases.append(({"version": "gemv"}, None, "version 'gemm'"))
    else:
        cases.append(({"checkpoint_format": "marlin"}, None, "supported: gptq, gptq_v2"))
    if desc:
        g_idx = tensors[f"{layer}.g_idx"]
        cases.append((None, (f"{layer}.g_idx", g_idx[:-1]), r"'\S+g_idx' has shape \(63,\)"))
        cases.append((None, (f"{layer}.g_idx", g_idx + 2), r"group indices 2..3, expected 0..1"))
    for i, (config, tensor, words) in enumerate(cases):
        with pytest.raises(ValueError, match=words):
            load_model(rewrite(legacy, tmp_path / str(i), config, tensor))


DESC_ACT = pytest.mark.parametrize("case_dirs", ["gptq-w4g32-asym-desc_act"], indirect=True)


@DESC_ACT
def test_gptq_v2_zero_points_are_read_as_stored(case_dirs, tmp_path) -> None:
    """The same integers written as gptq_v2 (zero points not minus one) load equal."""
    legacy, ct_dir, case = case_dirs
    write_legacy(ct_dir, tmp_path / "v2", ("gptq_v2", *case[1:]))
    v1, v2 = (jax.tree.leaves(load_model(d).params) for d in (legacy, tmp_path / "v2"))
    assert all(np.array_equal(a, b) for a, b in zip(v1, v2, strict=True))


@DESC_ACT
def test_activation_order_shards_as_vllm_does(case_dirs) -> None:
    """Row-parallel layers split g_idx with their inputs and keep every group's scale and
    zero point on each device; column-parallel ones keep g_idx whole."""
    params = load_model(case_dirs[0], mesh=make_mesh(2)).params["model"]["layers_0"]
    o, q = params["self_attn"]["o_proj"], params["self_attn"]["q_proj"]
    assert o["weight_g_idx"].sharding.spec == P(AXIS)
    assert o["weight_packed"].sharding.spec == P(None, AXIS)
    assert o["weight_scale"].sharding.spec == o["weight_zero_point"].sharding.spec == P()
    assert q["weight_g_idx"].sharding.spec == P()
    assert q["weight_scale"].sharding.spec == P(AXIS, None)


def test_packed_weights_take_the_bytes_of_their_bits(case_dirs, checkpoints) -> None:
    legacy, _, (_, bits, _, _, desc) = case_dirs
    bf16 = linear_bytes(load_model(checkpoints["llama"], "bfloat16"))
    ratio = linear_bytes(load_model(legacy, "bfloat16")) / bf16
    # 4 bits + a bfloat16 scale and an int8 zero point per 32 weights = 4.75 bits; g_idx
    # adds 32 bits per input, a bit per weight on these 32-row layers (0.01 at 4096).
    assert ratio <= {4: 0.3 + 0.06 * desc, 8: 0.55}[bits], ratio

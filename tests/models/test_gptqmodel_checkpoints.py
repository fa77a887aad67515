"""GPTQ and AWQ checkpoints that gptqmodel itself quantizes and writes, against gptqmodel
running them: logits and greedy choices.

gptqmodel does not install beside the pinned torch (see test_gptq_awq.py), so this
module runs only where it is installed (`pip install --no-deps gptqmodel` and its
helpers); CI skips it. Both sides run float16: gptqmodel's float32 CPU kernel
(TorchFusedLinear, torch 2.13) gives logits far from its own float16 ones.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from jvllm import LLM
from jvllm.testing import make_checkpoint
from tests.models.test_compressed_tensors import ENGINE, prompts
from tests.models.test_quantization import prompt_row

# gptqmodel's loader pool wants two CPU workers, more than a 2-core machine gets by default.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
gptqmodel = pytest.importorskip("gptqmodel")

# name -> quantize config (AWQ's clip search needs outputs in multiples of 64: wider model)
CASES = {
    "gptq-w4g32-asym-desc_act": dict(bits=4, group_size=32, desc_act=True, sym=False),
    "gptq-w8-channel-asym": dict(bits=8, group_size=-1, sym=False, act_group_aware=False),
    "awq-w4g32": dict(bits=4, group_size=32, sym=False, method="awq", format="gemm"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def quantized(request, tokenizer_dir, tmp_path_factory):
    from gptqmodel import GPTQModel, QuantizeConfig

    root = tmp_path_factory.mktemp("gptqmodel")
    src = make_checkpoint("llama", root / "llama", tokenizer_dir, hidden_size=128,
                          intermediate_size=256, dtype="float16")  # fmt: skip
    model = GPTQModel.load(str(src), QuantizeConfig(**CASES[request.param]), device="cpu")
    rng = random.Random(0)
    calibration = [
        {"input_ids": [rng.randrange(6, 500) for _ in range(64)], "attention_mask": [1] * 64}
        for _ in range(8)
    ]
    model.quantize(calibration, batch_size=1)
    model.save(str(root / request.param))
    tool = GPTQModel.load(str(root / request.param), device="cpu", dtype=torch.float16)
    return root / request.param, tool.model


def test_logits_match_gptqmodel(quantized) -> None:
    path, tool = quantized
    ids = prompts()[6]
    llm = LLM(str(path), dtype="float16", **ENGINE)
    (got,) = llm.engine.runner.forward_logits([prompt_row(ids)], every_token=True)
    with torch.no_grad():
        ref = tool(torch.tensor([ids])).logits[0].float().numpy()
    got = np.asarray(got, np.float32)
    # float16 on both sides, summed in different orders.
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95

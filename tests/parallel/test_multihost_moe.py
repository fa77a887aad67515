"""A mixture-of-experts model on two processes joined by jax.distributed (2 CPU devices
each): attention tensor parallel over the 4 devices and the 8 experts split 2 per
device (expert parallelism, so each process holds half of them); greedy tokens equal
one device's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from jvllm import LLM, SamplingParams
from tests.parallel.test_multihost import WORKER, free_port

REPO = Path(__file__).resolve().parents[2]


def test_expert_parallel_across_two_processes_matches_one_device(moe_checkpoints, tmp_path):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(6, 500, size=n)] for n in (5, 30, 70)]
    model = str(moe_checkpoints["qwen3_moe"])
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        # The workers import this tree's jvllm, not an installed one.
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    address = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    argv = [sys.executable, str(WORKER), model, address]
    procs = [
        subprocess.Popen(
            [*argv, str(i), str(outs[i]), "4", "1", "ep"], stdin=subprocess.PIPE, env=env, text=True
        )
        for i in range(2)
    ]
    for p in procs:
        p.stdin.write(json.dumps(prompts))
        p.stdin.close()
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0]
    results = [json.loads(o.read_text()) for o in outs]
    llm = LLM(model, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert results[0] == results[1] == single

"""Two processes joined by jax.distributed (2 CPU devices each) run TP=4, and PP=2 x
TP=2 (a stage on each process), like one device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jvllm import LLM, SamplingParams

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REPO = Path(__file__).resolve().parents[2]


def two_processes_equal_one_device(model: str, tmp_path: Path, layout: list[str]) -> None:
    """Runs `multihost_worker.py` on two processes joined by jax.distributed (2 CPU
    devices each; `layout`: the worker's TP, PP [and "ep"] arguments) over three prompts,
    and checks both report one device's greedy tokens."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(6, 500, size=n)] for n in (5, 30, 70)]
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        # The workers import this tree's jvllm, not an installed one.
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    address = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), model, address, str(i), str(outs[i]), *layout],
            stdin=subprocess.PIPE,
            env=env,
            text=True,
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


@pytest.mark.parametrize("tp,pp", [(4, 1), (2, 2)])
def test_two_processes_match_single_device(checkpoints, tmp_path, tp, pp):
    two_processes_equal_one_device(str(checkpoints["llama"]), tmp_path, [str(tp), str(pp)])

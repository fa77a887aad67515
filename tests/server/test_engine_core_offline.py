"""The offline `LLM` with `JVLLM_ENABLE_V1_MULTIPROCESSING=1`: its engine runs in an
engine-core process, greedy outputs equal Transformers', a bad request is refused before
it leaves, and `shutdown` leaves no process behind."""

from __future__ import annotations

import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.core.multiproc_engine import MultiprocEngine
from jvllm.engine.validation import InvalidRequestError
from tests.helpers import prompts
from tests.server import left_alive


@pytest.mark.slow  # 16 s of CPU, mostly the core's compiles; the client is the server's
def test_llm_in_an_engine_core_process_equals_transformers(checkpoints, monkeypatch):
    from jvllm.testing.hf_runner import HfRunner

    path = str(checkpoints["llama"])
    token_prompts = prompts(5, lengths=[4, 11, 19])
    with HfRunner(path, dtype="float32") as hf:
        expected = hf.generate_greedy(token_prompts, 5)
    monkeypatch.setenv("JVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(path, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
    engine = llm.engine
    assert isinstance(engine, MultiprocEngine)
    pids = list(engine._procs.pids)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in token_prompts],
            SamplingParams(temperature=0.0, max_tokens=5),
            use_tqdm=False,
        )
        for output, sample, prompt in zip(outputs, expected, token_prompts, strict=True):
            assert output.outputs[0].token_ids == sample[0][len(prompt) :]
        too_long = {"prompt_token_ids": [7] * 200}  # max_model_len is 128
        with pytest.raises(InvalidRequestError, match="128"):
            llm.generate(too_long, SamplingParams(max_tokens=4), use_tqdm=False)
        assert llm.get_metrics()["num_requests_running"] == 0
    finally:
        engine.shutdown()
    assert not left_alive(pids)

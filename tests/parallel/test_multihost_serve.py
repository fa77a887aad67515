"""`jvllm serve` across two processes joined by jax.distributed (2 CPU devices each):
the official openai client gets the single-process server's greedy texts, streaming
included, and its seeded samples, logprobs, prompt logprobs and regex-constrained
text; a clean stop of the leader stops the follower; a killed follower turns the
leader's /health to 503 and ends it with a non-zero status, and a killed leader ends
the follower likewise; processes started with different flags refuse to start. Also
the step messages' encoding."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from jvllm.parallel.step_channel import (
    Liveness,
    StepMessage,
    _first_difference,
)
from tests.server import ServerProcess, free_port

ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
PROMPTS = ["hello world", "the quick brown fox", "one two three four five six", "a"]
# Seconds: a follower is lost after 5 s without a heartbeat, and the leader exits 2 s
# after its engine is declared dead (bounds for a loaded machine, not the figures).
LOSS_DETECTED_S = 15
LEADER_EXIT_S = 30


@pytest.fixture(scope="module")
def deep(tmp_path_factory, tokenizer_dir):
    from jvllm.testing import make_checkpoint

    path = tmp_path_factory.mktemp("mh") / "llama4"
    return make_checkpoint("llama", path, tokenizer_dir, num_hidden_layers=4)


def texts(url: str, model: str) -> tuple[list[str], list[str]]:
    """Greedy completions of PROMPTS, then the same streamed (chunks joined)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    whole, streamed = [], []
    for prompt in PROMPTS:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        whole.append(out.choices[0].text)
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        streamed.append("".join(c.choices[0].text for c in chunks if c.choices))
    return whole, streamed


def extras(url: str, model: str) -> dict:
    """Requests whose step messages carry more than tokens: seeded n = 2 with logprobs
    (forked blocks, copy messages), echoed prompt logprobs (scoring targets), and a regex
    (the token bitmask)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    sampled = client.completions.create(
        model=model, prompt="one two three", max_tokens=8, n=2, temperature=0.8, seed=5,
        logprobs=2,
    )  # fmt: skip
    echoed = client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=2, temperature=0, echo=True,
        logprobs=1,
    )  # fmt: skip
    regex = client.completions.create(
        model=model, prompt="pick:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{2,6} [a-z]{2,6}"}},
    )  # fmt: skip
    return dict(
        texts=[c.text for c in sampled.choices] + [echoed.choices[0].text, regex.choices[0].text],
        logprobs=[lp for c in (*sampled.choices, echoed.choices[0])
                  for lp in c.logprobs.token_logprobs if lp is not None],
    )  # fmt: skip


def start_pair(model: str, flags: list[str], follower_flags: list[str] | None = None):
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for rank, extra in enumerate([flags, follower_flags or flags]):
        multihost = ["--coordinator-address", address, "--num-processes", "2"]
        args = [model, *ENGINE, *extra, *multihost, "--process-id", str(rank)]
        procs.append(ServerProcess(args, env=TWO_DEVICES))
    return procs


@pytest.fixture(scope="module")
def reference(deep):
    server = ServerProcess([str(deep), *ENGINE], env={"JAX_PLATFORMS": "cpu"})
    try:
        url = server.wait_ready().url
        return texts(url, str(deep)), extras(url, str(deep))
    finally:
        server.stop()


def test_pp2_tp2_over_two_processes_then_clean_stop(deep, reference):
    leader, follower = start_pair(str(deep), ["-pp", "2", "-tp", "2"])
    try:
        leader.wait_ready(300)
        assert texts(leader.url, str(deep)) == reference[0]
        got, want = extras(leader.url, str(deep)), reference[1]
        assert got["texts"] == want["texts"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
        assert follower.proc.poll() is None
        leader.proc.send_signal(15)  # SIGTERM: drain, then tell the follower to stop
        assert leader.wait_exit(60) == 0, leader.log()
        assert follower.wait_exit(60) == 0, follower.log()
        assert "ran " in follower.log() and "of its programs" in follower.log()
    finally:
        follower.stop()
        leader.stop()


def test_tp4_then_killed_follower_fails_the_leader(deep, reference):
    leader, follower = start_pair(str(deep), ["-tp", "4"])
    try:
        leader.wait_ready(300)
        assert texts(leader.url, str(deep)) == reference[0]
        follower.proc.kill()
        # Logged once the engine is declared dead; the server answers 503 for 2 s more.
        assert leader.wait_for_log("the engine loop died", LOSS_DETECTED_S), leader.log()
        assert httpx.get(leader.url + "/health", timeout=2).status_code == 503
        code = leader.wait_exit(LEADER_EXIT_S)
        assert code not in (0, None), leader.log()
        assert "sent no heartbeat" in leader.log()
    finally:
        follower.stop()
        leader.stop()


def test_killed_leader_ends_the_follower(deep):
    leader, follower = start_pair(str(deep), ["-pp", "2", "-tp", "2"])
    try:
        leader.wait_ready(300)
        leader.proc.kill()
        code = follower.wait_exit(LEADER_EXIT_S)
        assert code != 0, follower.log()
    finally:
        follower.stop()
        leader.stop()


def test_processes_with_different_flags_refuse_to_start(deep):
    leader, follower = start_pair(str(deep), ["-tp", "4"], ["-tp", "4", "--max-num-seqs", "4"])
    try:
        for proc in (leader, follower):
            assert proc.wait_exit(300) != 0
        for proc in (leader, follower):
            assert "disagree on engine_args.max_num_seqs" in proc.log(), proc.log()
    finally:
        follower.stop()
        leader.stop()


def test_step_message_round_trip():
    arrays = {
        "packed": np.arange(37, dtype=np.int32),
        "temperature": np.array([0.0, 0.7], np.float32),
        "seeds": np.array([1, 2**32 - 1], np.uint32),
        "mask": np.array([True, False, True]),
        "tables": np.arange(12, dtype=np.int32).reshape(3, 4),
        "empty": np.zeros((0, 5), np.int32),
    }
    message = StepMessage("forward", {"num_tokens": 64, "num_seqs": 8}, arrays)
    back = StepMessage.decode(message.encode())
    assert back.op == "forward" and back.statics == {"num_tokens": 64, "num_seqs": 8}
    assert list(back.arrays) == list(arrays)
    for name, array in arrays.items():
        assert back.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(back.arrays[name], array)
    with pytest.raises(ValueError, match="stray bytes"):
        StepMessage.decode(message.encode() + b"x")


def test_first_difference_names_the_field():
    a = {"engine_args": {"max_num_seqs": 8, "dtype": "auto"}, "config": "abc"}
    b = {"engine_args": {"max_num_seqs": 4, "dtype": "auto"}, "config": "abc"}
    assert _first_difference(a, a) is None
    assert _first_difference(a, b) == ("engine_args.max_num_seqs", 8, 4)


def _coordination_service() -> tuple[Any, Any]:
    """A one-process jax.distributed coordination service and a connected client,
    outside JAX's global state."""
    from jax._src.lib import _jax

    port = free_port()
    service = _jax.get_distributed_runtime_service(f"127.0.0.1:{port}", 1)
    client = _jax.get_distributed_runtime_client(f"127.0.0.1:{port}", 0, init_timeout=30)
    client.connect()
    return service, client


@pytest.mark.parametrize("stopped_first", [True, False])
def test_liveness_stopped_before_the_service_goes_reports_no_loss(stopped_first: bool) -> None:
    """As at exit (`atexit` stops the heartbeats before JAX shuts the service down): the
    service going away after `stop()` is no lost peer; without the stop it is one."""
    service, client = _coordination_service()
    lost: list[str] = []
    reported = threading.Event()

    def on_lost(reason: str) -> None:
        lost.append(reason)
        reported.set()

    liveness = Liveness(client, 0, 1, on_lost).start()
    assert liveness.alive()
    if stopped_first:
        liveness.stop()  # returns once the watch has ended: no beat can follow
    client.shutdown()
    service.shutdown()
    if stopped_first:
        assert lost == [] and liveness.alive()
    else:
        assert reported.wait(timeout=60), "the watch never noticed the service was gone"
        liveness.stop()
        assert len(lost) == 1 and "coordination service stopped answering" in lost[0]


def test_a_process_with_liveness_exits_cleanly_after_jax_shuts_down() -> None:
    """The heartbeats stop at exit before JAX shuts the coordination service down: a
    process whose last exit handler (run after JAX's) waits for the watch to end still
    exits with status 0, not as a process that lost its peers (a watch left running
    beats into the closed service and ends the process with status 1)."""
    script = f"""
import atexit


def wait_for_the_watch():
    from jvllm.parallel import step_channel

    step_channel.current_liveness()._thread.join(timeout=60)


# Registered before anything imports JAX, so run after JAX's handler: the watch must
# have ended by then, or it would find the service gone.
atexit.register(wait_for_the_watch)
import jax
from jvllm.parallel import step_channel
jax.distributed.initialize("127.0.0.1:{free_port()}", 1, 0)
step_channel.start_liveness(0, 1)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stopped answering" not in done.stderr

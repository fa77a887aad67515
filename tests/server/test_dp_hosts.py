"""Data parallelism across hosts, localhost standing in for two: a head (`jvllm serve -dp 2
--data-parallel-size-local 1 --data-parallel-address --data-parallel-rpc-port`, the API
server and rank 0) and a `--headless` process (rank 1, engine core only) that registers
with it over TCP, its core connecting out to the head's ports (as vLLM: the headless
host listens on none). Through the official openai client: outputs equal Transformers' greedy
ones with both cores used, an abort frees both cores' blocks, SIGTERM on the head drains
both and both processes exit 0; killing a headless process fails its in-flight request
with a 503 naming the core, /health 503, the head exits non-zero; no process or port is
left behind. Also: bad flag combinations, a headless process with no head, and one that
dies before its cores are ready (the head exits 1 naming its host) are clear errors."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from jvllm.server.process_args import DataParallelConfig, ProcessConfig
from tests.helpers import prompts
from tests.server import SMALL_ENGINE, ServerProcess, descendants, free_port, left_alive
from tests.server.test_engine_core import engine_samples

MAX_TOKENS = 6


def dp_flags(size: int, local: int, port: int) -> list[str]:
    return [
        "--data-parallel-size", str(size), "--data-parallel-size-local", str(local),
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port),
    ]  # fmt: skip


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (the head's handshake port, then one
    per remote rank for its API server)."""
    while True:
        port = free_port()
        if port + count <= 65536 and all(port_free(p) for p in range(port, port + count)):
            return port


def start_pair(path: str, size: int, head_local: int) -> tuple[ServerProcess, ServerProcess, int]:
    """A head with `head_local` ranks, and a headless process with the others. The head's
    logprobs name tokens "token_id:<id>"."""
    port = free_ports(1 + size - head_local)
    head_flags = [*dp_flags(size, head_local, port), "--return-tokens-as-token-ids"]
    head = ServerProcess([path, *SMALL_ENGINE, *head_flags])
    rest = dp_flags(size, size - head_local, port)
    headless = ServerProcess(
        [path, *SMALL_ENGINE, *rest, "--headless", "--data-parallel-start-rank", str(head_local)]
    )
    return head, headless, port


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def headless_pids(headless: ServerProcess) -> list[int]:
    """The pids of the headless process's cores, from its log."""
    found = re.search(
        r"engine cores of DP ranks \[[^\]]*\] \(pids \[([^\]]*)\]\) serving", headless.log()
    )
    return [int(p) for p in found.group(1).split(",")]


def wait_running(url: str, count: int) -> dict[str, float]:
    """Each engine's running requests, once `count` run in all (or after 30 s)."""
    running: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while sum(running.values()) < count and time.monotonic() < deadline:
        running = engine_samples(url, "vllm:num_requests_running")
        time.sleep(0.05)
    return running


@pytest.fixture(scope="module")
def env(checkpoints):
    path = str(checkpoints["llama"])
    head, headless, port = start_pair(path, 2, 1)
    try:
        from jvllm.testing.hf_runner import HfRunner

        token_prompts = prompts(5, lengths=[3, 9, 17, 30])
        with HfRunner(path, dtype="float32") as hf:  # built while the servers warm up
            expected = hf.generate_greedy(token_prompts, MAX_TOKENS)
        head.wait_ready()
        yield SimpleNamespace(
            head=head, headless=headless, port=port, path=path, prompts=token_prompts,
            expected=expected,
        )  # fmt: skip
    finally:
        head.stop()
        headless.stop()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "must be in [0, "),
        (
            {"data_parallel_size": 2, "data_parallel_size_local": 1, "headless": True,
             "data_parallel_start_rank": 2, "data_parallel_address": "10.0.0.1"},
            "data_parallel_start_rank=2 out of range",
        ),
        (
            {"data_parallel_size": 2, "data_parallel_size_local": 1, "headless": True,
             "data_parallel_start_rank": 1},
            "--headless needs --data-parallel-address",
        ),
        ({"data_parallel_size": 2, "data_parallel_size_local": 1}, "needs --data-parallel-address"),
        (
            {"data_parallel_size": 2, "data_parallel_start_rank": 1},
            "data_parallel_start_rank=1: the head",
        ),
    ],
)  # fmt: skip
def test_bad_flag_combinations_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DataParallelConfig(**kwargs)


def test_headless_with_api_servers_is_an_error():
    dp = DataParallelConfig(2, 1, "127.0.0.1", None, 1, True)
    with pytest.raises(ValueError, match="api_server_count=2 with --headless"):
        ProcessConfig(2, dp)


def test_headless_without_a_head_exits_with_a_clear_error(checkpoints):
    port = free_port()
    headless = ServerProcess(
        [str(checkpoints["llama"]), *dp_flags(2, 1, port), "--headless", "-dpr", "1"],
        env={"JVLLM_DP_HANDSHAKE_TIMEOUT_S": "1"},
    )
    assert headless.wait_exit(60) != 0
    assert f"no data-parallel head answered at tcp://127.0.0.1:{port} within 1 s" in headless.log()


def complete(url: str, prompt: list[int]) -> openai.types.Completion:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        return client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            logprobs=1,
        )


def test_outputs_equal_transformers_on_the_local_and_the_remote_core(env):
    url = env.head.url
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: complete(url, p), env.prompts * 2))
    for prompt, result, sample in zip(env.prompts * 2, results, env.expected * 2, strict=True):
        tokens = result.choices[0].logprobs.tokens
        assert [int(t.removeprefix("token_id:")) for t in tokens] == sample[0][len(prompt) :]
    generated = sum(r.usage.completion_tokens for r in results)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        tokens = engine_samples(url, "vllm:generation_tokens_total")
        if sum(tokens.values()) == generated:
            break
        time.sleep(0.1)
    assert set(tokens) == {"0", "1"} and min(tokens.values()) > 0, tokens
    assert sum(tokens.values()) == generated, tokens


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports these processes listen on (their sockets' inodes in /proc/net)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(FileNotFoundError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_only_the_head_listens(env):
    """As vLLM: the headless host's core connects out to the head, which binds the
    handshake port and the API server's port for rank 1 right after it."""
    headless = [env.headless.proc.pid, *descendants(env.headless.proc.pid)]
    assert listening_ports(headless) == set()
    head = [env.head.proc.pid, *descendants(env.head.proc.pid)]
    assert {env.port, env.port + 1} <= listening_ports(head)


def test_abort_frees_both_cores_blocks(env):
    """Two streams opened at once, one on each core (the second goes to the idle one),
    closed after their first chunk: both cores stop them early and free every block."""
    url = env.head.url
    prompt, max_tokens = env.prompts[0], 200
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    families = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    before = [engine_samples(url, f) for f in families]
    opened = threading.Barrier(2)

    def first_chunk() -> str:
        """Opens a stream with the other one, and closes it after its first chunk."""
        with (
            httpx.Client(base_url=url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            opened.wait(30)
            return next(response.iter_lines())

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chunks = list(pool.map(lambda _: first_chunk(), range(2)))
    assert all(chunk.startswith("data: ") for chunk in chunks), chunks
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        usage = engine_samples(url, "vllm:kv_cache_usage_perc")
        running = engine_samples(url, "vllm:num_requests_running")
        if set(usage) == {"0", "1"} and not any(usage.values()) and not any(running.values()):
            break
        time.sleep(0.1)
    assert usage == {"0": 0.0, "1": 0.0} and running == {"0": 0.0, "1": 0.0}
    prompt_tokens, generated = (
        {e: engine_samples(url, f)[e] - was[e] for e in was}
        for f, was in zip(families, before, strict=True)
    )
    assert prompt_tokens == {"0": len(prompt), "1": len(prompt)}, prompt_tokens
    assert max(generated.values()) < max_tokens, generated


def test_sigterm_on_the_head_drains_both_cores_and_stops_the_headless(env):
    """Two requests in flight, one on each core (as in the abort test), when the head gets
    SIGTERM: both finish whole; then the head tells the headless process to stop: both
    exit 0, no process or port left."""
    head, headless = env.head, env.headless
    processes = descendants(head.proc.pid) + descendants(headless.proc.pid)
    ports = [env.port, env.port + 1]  # the handshake's, the API server's for rank 1
    max_tokens = 250  # the prompt's 3 tokens + 250 <= max_model_len 256
    body = {"prompt": env.prompts[0], "max_tokens": max_tokens, "ignore_eos": True}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    opened = threading.Barrier(3)

    def stream() -> list[dict]:
        with (
            httpx.Client(base_url=head.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body | streamed) as response,
        ):
            opened.wait(30)  # both requests added: the main thread signals the head
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        return [json.loads(line) for line in lines]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(stream) for _ in range(2)]
        opened.wait(30)
        head.proc.send_signal(signal.SIGTERM)
        for future in futures:
            events = future.result()
            finishes = [c["finish_reason"] for e in events for c in e["choices"]]
            assert finishes[-1] == "length", events[-2:]
            assert events[-1]["usage"]["completion_tokens"] == max_tokens
    assert head.wait_exit(60) == 0
    assert re.search(r"waiting up to \d+ s for 2 in flight", head.log()), head.log()[-3000:]
    assert headless.wait_exit(30) == 0
    assert "the head said stop" in headless.log()
    assert not left_alive(processes)
    assert all(port_free(p) for p in ports), ports


def test_killed_headless_process_fails_its_requests_names_its_core(checkpoints):
    """The head runs no core itself (size 1, local 0): rank 0 is the headless one."""
    head, headless, port = start_pair(str(checkpoints["llama"]), 1, 0)
    try:
        head.wait_ready()
        processes = descendants(head.proc.pid) + descendants(headless.proc.pid)
        [core_pid] = headless_pids(headless)
        body = {"prompt": prompts(6, [8])[0], "max_tokens": 200, "ignore_eos": True}
        with (
            httpx.Client(base_url=head.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response,
        ):
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(headless.proc.pid, signal.SIGKILL)
            events = [line[6:] for line in lines if line.startswith("data: {")]
        errors = [json.loads(e)["error"] for e in events if '"error"' in e]
        name = f"engine core 0 (pid {core_pid} on {socket.gethostname()}) died"
        assert any(e["code"] == "engine_dead" and name in e["message"] for e in errors), errors
        assert httpx.get(head.url + "/health", timeout=10).status_code == 503
        assert head.wait_exit(30) != 0
        assert not left_alive(processes)
        assert port_free(port) and port_free(port + 1)
    finally:
        head.stop()
        headless.stop()


def test_headless_process_dying_before_its_cores_are_ready_fails_the_head(checkpoints):
    """Killed once registered, while its core still builds: the head (no core of its own)
    exits 1 naming the host, and leaves no process or port behind."""
    head, headless, port = start_pair(str(checkpoints["llama"]), 1, 0)
    try:
        assert head.wait_for_log("registered: ranks [0]", 120), head.log()[-3000:]
        processes = descendants(head.proc.pid) + descendants(headless.proc.pid)
        os.kill(headless.proc.pid, signal.SIGKILL)
        assert head.wait_exit(60) == 1
        went = f"the headless process on {socket.gethostname()} (DP ranks [0]) went away before"
        assert went in head.log(), head.log()[-3000:]
        assert not left_alive(processes)
        assert port_free(port)
    finally:
        head.stop()
        headless.stop()


def test_the_head_ignores_foreign_messages_and_refuses_zero_ranks():
    """Another program on the handshake port (bytes that are no handshake message, a
    message of several frames) is logged and ignored; a registration of no ranks gets a
    clear refusal; a proper one is served."""
    import zmq

    from jvllm.engine.core import hosts
    from jvllm.engine.core import messages as m

    port = free_ports(3)
    dp = SimpleNamespace(
        data_parallel_size=2, local_size=1, rpc_port=port, data_parallel_address="127.0.0.1",
        handshake_address=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    head = hosts.RemoteCores(dp, 1, None)
    answers: list = []
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)

    def headless() -> None:
        peer.connect(dp.handshake_address)
        peer.send(b"\x93not a handshake")
        peer.send_multipart([b"two", b"frames"])
        peer.send(m.encode(hosts.Register(1, 0, 2, "nohost")))
        answers.append(hosts.decode_from(peer.recv(), "head"))
        peer.send(m.encode(hosts.Register(1, 1, 2, "somehost")))
        answers.append(hosts.decode_from(peer.recv(), "head"))
        peer.send(m.encode(hosts.Ready([4321])))
        if isinstance(hosts.decode_from(peer.recv(), "head"), hosts.Stop):
            peer.send(m.encode(hosts.Stopped()))

    thread = threading.Thread(target=headless, daemon=True)
    thread.start()
    try:
        head.wait(lambda: [])
        assert head.pids == {1: 4321}
        assert "size_local=0" in answers[0].error
        assert answers[1].error is None
        assert answers[1].frontends == [[f"tcp://127.0.0.1:{port + 1}"]]
    finally:
        head.stop()
        thread.join(5)
        peer.close()
        context.term()


def test_the_heads_ports_are_checked_before_any_core_starts():
    """`check_head_ports` (called by the head before its cores and coordinator start):
    the ports past 65535, or one in use, are a clear error naming them."""
    from jvllm.engine.core.hosts import check_head_ports

    def config(port: int) -> SimpleNamespace:
        return SimpleNamespace(
            data_parallel_size=3, local_size=1, rpc_port=port, data_parallel_address="127.0.0.1"
        )

    with pytest.raises(ValueError, match="rpc-port 65531 is too high: .* 65531 .. 65536"):
        check_head_ports(config(65531), 2, free=True, coordinator=True)
    port = free_ports(6)
    check_head_ports(config(port), 2, free=True, coordinator=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 5))  # the coordinator's
        taken.listen()
        check_head_ports(config(port), 2, free=True, coordinator=False)
        with pytest.raises(ValueError, match=rf"ports \[{port + 5}\] on 127.0.0.1 are in use"):
            check_head_ports(config(port), 2, free=True, coordinator=True)

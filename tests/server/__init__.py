"""Helpers for the server tests: a real `jvllm serve` process on a free localhost port.

Each test module starts its own server once (engine warm-up compiles take seconds)
with small engine limits, and stops it at the end. Tests talk to it over HTTP only.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

API_KEY = "test-key-0123456789"
# Small limits keep warm-up and every test fast on a 2-core CI runner.
SMALL_ENGINE = [
    "--max-model-len", "256",
    "--max-num-seqs", "16",
    "--max-num-batched-tokens", "64",
    "--block-size", "16",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -c <prelude> + jvllm.cli.main(["serve", *args])`; or `python -m MODULE
    *args` when `module` is given. `verify` (the server's self-signed certificate as an
    SSL context) means the server speaks HTTPS. A thread collects its output, so that
    `wait_for_log` can wait for a line without polling."""

    def __init__(
        self,
        args: list[str],
        prelude: str = "",
        env: dict[str, str] | None = None,
        module: str | None = None,
        verify: ssl.SSLContext | None = None,
    ):
        self.port = free_port()
        self.verify = verify or True
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self._lines: list[str] = []
        self._grew = threading.Condition()
        argv = ["serve", *args, "--port", str(self.port), "--disable-access-log"]
        code = f"import sys\n{prelude}\nfrom jvllm.cli import main\nsys.exit(main({argv!r}))\n"
        command = ["-c", code] if module is None else ["-m", module, *argv[1:]]
        self.proc = subprocess.Popen(
            [sys.executable, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=Path(__file__).resolve().parents[2],
        )
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.proc.stdout:  # until the process closes its output
            with self._grew:
                self._lines.append(line)
                self._grew.notify_all()

    def log(self) -> str:
        with self._grew:
            return "".join(self._lines)

    def wait_for_log(self, text: str, timeout: float) -> bool:
        """Whether `text` appears in the output within `timeout` seconds."""
        with self._grew:
            return self._grew.wait_for(lambda: text in "".join(self._lines), timeout)

    def wait_ready(self, timeout: float = 240.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                health = httpx.get(self.url + "/health", timeout=1.0, verify=self.verify)
                if health.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout}s:\n{self.log()}") from None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (children first found, then theirs)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def left_alive(pids: list[int], timeout: float = 10.0) -> dict[int, bytes]:
    """Those of `pids` still running after `timeout` seconds, with their command lines
    (multiprocessing's resource tracker ends a moment after its parent)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {p: Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in pids if alive(p)}


def metrics(url: str) -> dict[str, float]:
    """Family name (counters without `_total`) -> value, for the unlabelled jvllm samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (family.name, family.name + "_total"):
                values[family.name] = sample.value
    return values


def wait_metrics(
    url: str, done: Callable[[dict[str, float]], bool], timeout: float
) -> dict[str, float]:
    """Reads /metrics until `done` holds of them (or `timeout` seconds pass)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Waits until no request runs or waits and no KV block is held."""
    return wait_metrics(
        url,
        lambda m: (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0
        ),
        timeout,
    )


def auth_headers(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}

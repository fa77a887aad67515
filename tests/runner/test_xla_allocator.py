"""XLA's allocator settings (jvllm.runner.xla_allocator).

What happens before JAX's backend starts is checked in fresh subprocesses, since this
test process started its backend long ago. A GPU platform is asked for by name
(JAX_PLATFORMS=cuda), which this machine cannot start: the checks never start it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax._src import compiler

from jvllm.runner import xla_allocator as xa

REPO = Path(__file__).resolve().parents[2]
CONFIGURE = """
import json, os, sys
import jax
{before}
from jvllm.runner import xla_allocator as xa
setting = xa.configure_allocator({utilization})
again = xa.configure_allocator(0.3)  # the first decision stands
print(json.dumps(dict(how=setting.how, again=again.how, started=xa.backend_started(),
      env={{k: os.environ.get(k) for k in xa.USER_SETTINGS}})))
"""


USER_VALUES = {xa.FRACTION_ENV: "0.6", xa.PREALLOCATE_ENV: "false", xa.ALLOCATOR_ENV: "platform"}
# name -> (environment, code run before, utilization)
SCENARIOS = {
    "gpu": ({"JAX_PLATFORMS": "cuda"}, "", 0.5),
    "cpu": ({"JAX_PLATFORMS": "cpu"}, "", 0.5),
    # A JAX program used its devices, then asks for a GPU engine: too late to set.
    "started": (
        {"JAX_PLATFORMS": "cpu"},
        "jax.devices(); jax.config.update('jax_platforms', 'cuda')",
        0.5,
    ),
    "out of range": ({"JAX_PLATFORMS": "cuda"}, "", 1.5),
    "not a number": ({"JAX_PLATFORMS": "cuda"}, "", "'0.9'"),
    **{f"user {k}": ({"JAX_PLATFORMS": "cuda", k: v}, "", 0.5) for k, v in USER_VALUES.items()},
}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    """Each scenario in a fresh process, all at once."""
    clean = {k: v for k, v in os.environ.items() if k not in (*xa.USER_SETTINGS, "JAX_PLATFORMS")}
    procs = {}
    for name, (env, before, utilization) in SCENARIOS.items():
        code = CONFIGURE.format(before=before, utilization=utilization)
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code],
            env=clean | env | {"PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{name}: {stderr[-2000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


NOTHING_SET = dict.fromkeys(xa.USER_SETTINGS)


def test_the_fraction_is_set_from_utilization_before_a_gpu_backend_starts(outcomes):
    env = NOTHING_SET | {xa.FRACTION_ENV: "0.5"}
    assert outcomes["gpu"] == dict(how=xa.SET, again=xa.SET, started=False, env=env)


@pytest.mark.parametrize("given", xa.USER_SETTINGS)
def test_a_users_allocator_settings_are_left_alone(outcomes, given):
    out = outcomes[f"user {given}"]
    assert out["how"] == xa.USER and not out["started"]
    assert out["env"] == NOTHING_SET | {given: USER_VALUES[given]}


def test_on_cpu_nothing_changes(outcomes):
    assert outcomes["cpu"] == dict(how=xa.NOT_GPU, again=xa.NOT_GPU, started=False, env=NOTHING_SET)


def test_after_the_backend_started_it_takes_what_is_there(outcomes):
    out = outcomes["started"]
    assert out == dict(how=xa.STARTED, again=xa.STARTED, started=True, env=NOTHING_SET)


@pytest.mark.parametrize("case", ["out of range", "not a number"])
def test_a_bad_utilization_is_not_applied_and_does_not_fail(outcomes, case):
    """CacheConfig rejects it later, with the field's name; here it changes nothing."""
    out = outcomes[case]
    assert out["how"] == xa.NOT_GPU and out["again"] == xa.SET  # 0.3 then applies
    assert out["env"] == NOTHING_SET | {xa.FRACTION_ENV: "0.3"}


def test_device_limits_read_the_total_back_from_the_allocators_limit(monkeypatch):
    gib = 1 << 30
    stats = {"bytes_limit": int(140 * gib * 0.9), "pool_bytes": int(140 * gib * 0.9)}
    for k in xa.USER_SETTINGS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(xa.FRACTION_ENV, "0.9")
    assert xa.device_limits(stats) == (140 * gib, int(140 * gib * 0.9))
    # The driver granted less than the fraction: the pool caps what may be used.
    assert xa.device_limits(stats | {"pool_bytes": 100 * gib}) == (140 * gib, 100 * gib)
    monkeypatch.setenv(xa.PREALLOCATE_ENV, "false")  # growing: the pool is no cap
    assert xa.device_limits(stats | {"pool_bytes": 10 * gib})[1] == int(140 * gib * 0.9)
    monkeypatch.delenv(xa.FRACTION_ENV)  # XLA's default fraction
    assert xa.device_limits({"bytes_limit": int(140 * gib * 0.75)})[0] == 140 * gib


def test_the_device_memory_size_joins_the_compile_options():
    options = compiler.get_compile_options(
        1, 1, env_options_overrides={"xla_gpu_memory_limit_slop_factor": 90}
    )
    sized = xa.with_device_memory_size(options, 123_456_789_012)
    field = bytes([15 << 3]) + xa._varint(123_456_789_012)
    assert field in sized.SerializeAsString() and field not in options.SerializeAsString()
    assert sized.env_option_overrides == [("xla_gpu_memory_limit_slop_factor", 90)]
    assert sized.executable_build_options.use_spmd_partitioning
    with xa.compile_memory_size(1 << 30):
        inside = compiler.get_compile_options(1, 1).SerializeAsString()
    outside = compiler.get_compile_options(1, 1).SerializeAsString()
    assert bytes([15 << 3]) + xa._varint(1 << 30) in inside
    assert inside != outside and compiler.get_compile_options(1, 1).SerializeAsString() == outside


LLM_START = """
import json, os, sys
from jax._src import xla_bridge
at_start = []
xla_bridge.register_backend_initialization_hook(
    lambda backend: at_start.append(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")))
from jvllm import LLM
llm = LLM(model=sys.argv[1], gpu_memory_utilization=0.6, max_model_len=64, max_num_seqs=2,
          max_num_batched_tokens=16, compilation_cache_dir="")
print(json.dumps(dict(at_start=at_start, blocks=llm.get_metrics()["num_total_blocks"])))
"""


def test_llm_sets_the_fraction_before_the_backend_starts(checkpoints):
    """`LLM(...)` with a GPU platform asked for (cuda before cpu: this machine falls back
    to its CPU): every backend starts with the fraction already set."""
    clean = {k: v for k, v in os.environ.items() if k not in xa.USER_SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", LLM_START, str(checkpoints["llama"])],
        env=clean | {"JAX_PLATFORMS": "cuda,cpu", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["at_start"] and set(out["at_start"]) == {"0.6"}, out
    assert out["blocks"] > 1

"""XLA:CPU's compute cores and the Python threads' cores (JVLLM_CPU_THREADS_BIND)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jvllm.runner.cpu_binding import CpuBinding, parse_cpu_list, plan_binding


def test_parse_cpu_list():
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)
    assert parse_cpu_list(" 3 , 1-1 ") == (1, 3)
    with pytest.raises(ValueError, match="core list such as"):
        parse_cpu_list("0-x")
    with pytest.raises(ValueError, match="not a range"):
        parse_cpu_list("4-2")


def test_plan_binding():
    usable = (0, 1, 2, 3)
    assert plan_binding("all", usable, None) is None
    assert plan_binding("auto", usable, None) == CpuBinding((0, 1, 2), (3,))
    assert plan_binding("auto", usable, 2) == CpuBinding((0, 1), (2, 3))
    assert plan_binding("auto", (0,), None) is None  # nothing to spare: not bound
    assert plan_binding("0-1", usable, None) == CpuBinding((0, 1), (2, 3))
    assert plan_binding("0-3", usable, None) == CpuBinding(usable, usable)
    with pytest.raises(ValueError, match=r"cores \[7\] are not usable"):
        plan_binding("0,7", usable, None)
    with pytest.raises(ValueError, match="reserve at least one core"):
        plan_binding("auto", usable, 0)


_PROBE = textwrap.dedent(
    """
    import glob, json, threading
    import jax
    if {started}:
        jax.devices()
    from jvllm.runner.cpu_binding import bind_cpu_threads
    binding = bind_cpu_threads()
    import jax.numpy as jnp
    (jnp.ones((256, 256)) @ jnp.ones((256, 256))).block_until_ready()
    later = []
    t = threading.Thread(target=lambda: later.append(sorted(__import__("os").sched_getaffinity(0))))
    t.start(); t.join()
    pools = set()
    for task in glob.glob("/proc/self/task/*"):
        if open(task + "/comm").read().strip().startswith("tf_XLA"):
            status = open(task + "/status").read().split("Cpus_allowed_list:")[1].split()[0]
            pools.add(status)
    print(json.dumps({{"binding": binding and [binding.compute, binding.python],
                      "pool": sorted(pools), "later": later[0]}}))
    """
)


def _probe(started: bool) -> dict:
    # A fresh environment: what other tests of this process exported stays out.
    keep = ("PATH", "HOME", "PYTHONPATH", "LANG", "TMPDIR", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(JVLLM_CPU_THREADS_BIND="auto", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(started=started)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="binding needs Linux and two usable cores",
)
def test_auto_binding_puts_xla_and_python_on_their_cores():
    usable = sorted(os.sched_getaffinity(0))
    bound = _probe(started=False)
    compute, python = usable[:-1], usable[-1:]
    assert bound["binding"] == [compute, python]
    # XLA's pool took the compute cores; a thread started afterwards gets the reserved one.
    assert [list(parse_cpu_list(cores)) for cores in bound["pool"]] == [compute]
    assert bound["later"] == python
    # A backend already running is left alone (its pool was sized without the binding).
    late = _probe(started=True)
    assert late["binding"] is None
    assert late["later"] == usable

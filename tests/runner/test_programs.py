"""The runner's programs and their executables kept across starts (jvllm.runner.programs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.runner.programs import ExecutableStore, Program

# A constant new to every session: JAX's persistent cache (on in any process where an
# engine ran before) never holds these programs, and the store writes fresh compiles only.
SALT = float(np.random.default_rng().integers(1, 1 << 20))


def step(params: dict, caches: list, x: jax.Array, shape: int, extra: jax.Array | None = None):
    y = x * params["w"] + shape + SALT
    if extra is not None:
        y = y + extra
    return y, [c + x.sum() for c in caches]


def make_program(store: ExecutableStore | None) -> Program:
    return Program(
        step, "step", store, static_argnames=("shape",), donate_argnames=("caches",), fixed=(0, 1)
    )


def run(program: Program, caches: list) -> tuple[list[np.ndarray], list]:
    params = {"w": jnp.arange(4.0)}
    outs = []
    for shape, x in ((2, jnp.ones(4)), (3, jnp.ones(4)), (2, jnp.ones(8)[:4] * 2)):
        y, caches = program(params, caches, x, shape=shape)
        outs.append(np.asarray(y))
    y, caches = program(params, caches, jnp.ones(4), shape=2, extra=jnp.full(4, 5.0))
    outs.append(np.asarray(y))
    return outs, caches


def test_one_executable_per_signature_read_back_by_a_new_store(tmp_path: Path) -> None:
    first = make_program(ExecutableStore(tmp_path, "scope-a"))
    caches = [jnp.zeros(4), jnp.zeros(4)]
    want, new_caches = run(first, caches)
    assert caches[0].is_deleted()  # donated, as jax.jit's own donation
    # Static 2 and 3, then the same as the first call, then one more (dynamic) argument.
    assert len(first.executables) == 3
    assert first.store is not None and (first.store.written, first.store.loaded) == (3, 0)

    again = make_program(ExecutableStore(tmp_path, "scope-a"))
    got, _ = run(again, [jnp.zeros(4), jnp.zeros(4)])
    assert again.store is not None and (again.store.written, again.store.loaded) == (0, 3)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    plain, _ = run(make_program(None), [jnp.zeros(4), jnp.zeros(4)])
    for g, w in zip(plain, want, strict=True):
        np.testing.assert_array_equal(g, w)

    other = make_program(ExecutableStore(tmp_path, "scope-b"))  # another configuration
    run(other, [jnp.zeros(4), jnp.zeros(4)])
    assert other.store is not None and (other.store.written, other.store.loaded) == (3, 0)


def test_fixed_arguments_are_still_checked() -> None:
    program = make_program(None)
    caches = [jnp.zeros(4), jnp.zeros(4)]
    _, caches = program({"w": jnp.ones(4)}, caches, jnp.ones(4), shape=2)
    # Weights of another shape look up the same executable, which refuses them.
    with pytest.raises(TypeError, match="Argument types differ"):
        program({"w": jnp.ones(5)}, caches, jnp.ones(4), shape=2)


def test_an_unreadable_executable_is_compiled_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    want, _ = run(make_program(ExecutableStore(tmp_path, "s")), [jnp.zeros(4), jnp.zeros(4)])
    files = sorted(tmp_path.rglob("*.jex"))
    assert len(files) == 3
    files[0].write_bytes(b"not an executable")
    store = ExecutableStore(tmp_path, "s")
    got, _ = run(make_program(store), [jnp.zeros(4), jnp.zeros(4)])
    assert "unreadable" in caplog.text
    assert (store.loaded, store.written) == (2, 1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


_JAX_CACHE_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jvllm.runner.programs import ExecutableStore, Program
written = []
for store_dir in (sys.argv[2], sys.argv[3]):
    store = ExecutableStore(store_dir, "scope")
    program = Program(lambda x: jnp.sin(x) * 2, "f", store)  # a new jit: compiles again
    program(jnp.ones(3)).block_until_ready()
    written.append(store.written)
print(json.dumps(written))
"""


def test_executables_from_jax_persistent_cache_are_not_stored(tmp_path: Path) -> None:
    """With JAX's persistent cache on, a second compile of the same program is served by
    it; the store keeps only the first, fresh, compile."""
    dirs = [str(tmp_path / name) for name in ("jax", "store1", "store2")]
    done = subprocess.run(
        [sys.executable, "-c", _JAX_CACHE_SCRIPT, *dirs],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [1, 0]


_START_SCRIPT = """
import json, sys
from jvllm import LLM, SamplingParams
model, cache, max_num_seqs = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model, max_model_len=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
          compilation_cache_dir=cache)
runner = llm.llm_engine.runner
store = runner.executable_store
built = runner.num_compilations
prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
print(json.dumps(dict(loaded=store.loaded, written=store.written, programs=built,
                      forwards=len(runner._forward_fn.executables),
                      after=runner.num_compilations, scope=str(store.directory),
                      tokens=[o.outputs[0].token_ids for o in outs])))
"""


def start(model: Path, cache: Path, max_num_seqs: int) -> dict:
    """One engine start in a fresh process (as a second start of a server is)."""
    cmd = [sys.executable, "-c", _START_SCRIPT, str(model), str(cache), str(max_num_seqs)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_start_loads_every_program(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Same checkpoint and engine arguments: the second start loads every program but the
    model forwards (on CPU devices JAX's persistent cache keeps those) and its greedy
    outputs equal the first's; other engine arguments share no stored program."""
    first, second = (start(checkpoints["llama"], tmp_path, 8) for _ in range(2))
    other = start(checkpoints["llama"], tmp_path, 4)
    for run in (first, second, other):
        assert run["after"] == run["programs"] > run["forwards"] > 0  # nothing new later
    stored = first["programs"] - first["forwards"]
    assert (first["written"], first["loaded"]) == (stored, 0)
    assert (second["written"], second["loaded"]) == (0, stored)
    assert second["scope"] == first["scope"] != other["scope"] and other["loaded"] == 0
    assert first["tokens"] == second["tokens"] == other["tokens"]

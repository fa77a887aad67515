"""The pytest plugin in a project of its own, and `jvllm compare`: a vLLM-style model
test file in a fresh directory passes on a tiny checkpoint and fails, with the prompt,
position, tokens, texts and logprobs, on a checkpoint whose weights differ from its
Transformers reference; the command line gives the same verdicts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jvllm.cli import main
from jvllm.testing import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "32"]

# Written as vLLM's tests/models/language/generation tests are.
MODEL_TEST = """
import pytest

from jvllm.testing import check_logprobs_close, check_outputs_equal

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32)


@pytest.mark.parametrize("max_tokens", [8])
@pytest.mark.parametrize("num_logprobs", [4])
def test_models(hf_runner, vllm_runner, example_prompts, model, max_tokens, num_logprobs):
    with hf_runner(model) as hf_model:
        hf_logprobs = hf_model.generate_greedy_logprobs_limit(
            example_prompts, max_tokens, num_logprobs
        )
        hf_outputs = hf_model.generate_greedy(example_prompts, max_tokens)
    with vllm_runner(model, **ENGINE) as vllm_model:
        vllm_logprobs = vllm_model.generate_greedy_logprobs(
            example_prompts, max_tokens, num_logprobs
        )
        vllm_outputs = vllm_model.generate_greedy(example_prompts, max_tokens)
    check_logprobs_close(
        outputs_0_lst=hf_logprobs, outputs_1_lst=vllm_logprobs, name_0="hf", name_1="vllm"
    )
    check_outputs_equal(
        outputs_0_lst=hf_outputs, outputs_1_lst=vllm_outputs, name_0="hf", name_1="vllm"
    )


@pytest.mark.gpu
def test_on_a_gpu_only():
    import jax

    assert jax.default_backend() == "gpu"
"""


@pytest.fixture(scope="module")
def other(checkpoints, tokenizer_dir, tmp_path_factory) -> Path:
    """The llama checkpoint's architecture and tokenizer with other random weights."""
    return make_checkpoint(
        "llama", tmp_path_factory.mktemp("other") / "other", tokenizer_dir, seed=1
    )


def entry_point_site(root: Path) -> Path:
    """A folder holding a distribution's metadata with pyproject's pytest11 entry point
    only: on the path, pytest finds the plugin as it finds an installed jvllm's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["pytest11"]["jvllm"]
    info = root / "jvllm_pytest_entry_point-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: jvllm-pytest-entry-point\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(f"[pytest11]\njvllm = {target}\n")
    return root


def run_suite(suite: Path, site: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest in `suite`, importing this checkout's jvllm, the plugin by its entry point."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=suite, env=env, capture_output=True, text=True, check=False)


def test_a_vllm_style_suite_passes_on_the_checkpoint_and_fails_on_other_weights(
    checkpoints, other, tmp_path
):
    suite = tmp_path / "model_team"
    suite.mkdir()
    (suite / "test_models.py").write_text(MODEL_TEST)
    same = str(checkpoints["llama"])
    site = entry_point_site(tmp_path / "site")
    done = run_suite(
        suite, site, "-q", "-rfs", "--strict-markers", "--jvllm-dtype", "float32",
        "--jvllm-model", same, "--jvllm-reference", same,
        "--jvllm-model", str(other), "--jvllm-reference", same,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, out[-3000:] + done.stderr[-3000:]
    assert "1 failed, 1 passed, 1 skipped" in out, out[-3000:]
    assert f"FAILED test_models.py::test_models[{other}-4-8]" in out
    assert re.search(r"SKIPPED \[1\] test_models.py:\d+: needs an NVIDIA GPU", out)
    failure = out[out.index("AssertionError: prompt ") :]
    assert "hf and vllm differ at output token" in failure
    assert "logprob in hf" in failure and "logprob in vllm" in failure
    assert "a real divergence: " in failure and "hf text: " in failure
    # Each side's row: its token id and text, then that token's logprob in hf and in vllm
    # (a number, or a bound where it is not in that side's top-4).
    logprob = r"(-\d+\.\d{4}|< -\d+\.\d{4} \(not top-4\))"
    for name in ("hf", "vllm"):
        row = rf"\nE\s+{name}\s+\d+\s+'.*'\s+{logprob}\s+{logprob}\n"
        assert re.search(row, failure), failure[:2000]
    # The run above found the plugin by its entry point; `-p no:jvllm` turns it off.
    off = run_suite(suite, site, "-q", "-p", "no:jvllm", "--fixtures", "test_models.py")
    assert off.returncode == 0 and "hf_runner" not in off.stdout, off.stdout[-2000:]


def test_jvllm_compare_prints_a_table_and_exits_1_on_a_real_divergence(
    checkpoints, other, tmp_path, capsys
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world how are you today\n\nThe quick brown fox\n")
    same = str(checkpoints["llama"])
    flags = ["--prompts", str(prompts), "--max-tokens", "6", "--dtype", "float32", *ENGINE_FLAGS]
    assert main(["compare", same, *flags]) == 0
    table = capsys.readouterr().out
    assert table.split("\n")[0].split()[:5] == ["#", "hf", "jvllm", "equal", "verdict"]
    assert "2 prompts: 2 equal, 0 near-ties, 0 diverged" in table
    assert main(["compare", str(other), "--reference", same, *flags]) == 1
    report = capsys.readouterr().out
    assert "DIVERGED" in report and "hf and jvllm differ at output token" in report
    assert main(["compare", same, "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err

"""examples/grpo_demo.py for two steps: the rollout logprobs of jvllm equal the trainer's
plain JAX forward on the same float32 parameters within 1e-5, before and after an
`update_weights`, and the engine compiles nothing after its first rollout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_demo.py"


def test_grpo_demo_two_steps_match_the_trainer_logprobs():
    spec = importlib.util.spec_from_file_location("grpo_demo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--steps", "2", "--group", "2", "--max-tokens", "12", "--max-num-batched-tokens", "64"]
    summary = module.main(argv)
    assert len(summary["steps"]) == 2
    for step in summary["steps"]:
        assert step["rollout_tokens"] > 0
        assert step["max_abs_logprob_diff"] <= 1e-5, step
    compiled = summary["num_compilations"]
    assert compiled["end"] == compiled["after_first_rollout"]

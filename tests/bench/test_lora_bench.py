"""Smoke test of bench/lora.py: tiny sizes, well-formed and self-consistent figures
(never a speed: CI machines vary too much)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lora_bench_tiny_preset(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    cmd = [
        sys.executable, "bench/lora.py", "--preset", "tiny", "--num-prompts", "4",
        "--max-tokens", "8", "--reps", "1", "--rank", "8",
        "--models-dir", str(tmp_path / "models"), "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = ("base_alone", "lora_0_adapters", "lora_1_adapter", "lora_4_adapters")
    assert set(result["output_tok_s"]) == set(cases)
    for case in cases:
        assert result["output_tok_s"][case] == max(result["output_tok_s_every_rep"][case])
        ratio = result["output_tok_s"][case] / result["output_tok_s"]["base_alone"]
        assert result["ratio_over_base_alone"][case] == pytest.approx(ratio)
    assert result["new_compilations"] == 0
    flops = result["matmul_flops_per_token"]
    assert 0 < flops["lora_fraction"] == pytest.approx(flops["lora"] / flops["base"])

"""A mixture-of-experts model on two processes joined by jax.distributed (2 CPU devices
each): attention tensor parallel over the 4 devices and the 8 experts split 2 per
device (expert parallelism, so each process holds half of them); greedy tokens equal
one device's."""

from __future__ import annotations

from tests.parallel.test_multihost import two_processes_equal_one_device


def test_expert_parallel_across_two_processes_matches_one_device(moe_checkpoints, tmp_path):
    model = str(moe_checkpoints["qwen3_moe"])
    two_processes_equal_one_device(model, tmp_path, ["4", "1", "ep"])

"""Output tokens per second with LoRA adapters: the base model alone (LoRA off) against
one engine with LoRA on serving the same batch with 0, 1 and 4 adapters mixed.

Builds the preset's random Llama checkpoint (`bench/common.py`) and four random PEFT
adapters of rank `--rank` on every target (q/k/v/o/gate/up/down; PEFT's own
`save_pretrained`), then runs one batch of `--num-prompts` equal-length prompts, greedy,
`--max-tokens` new tokens each with EOS ignored, after each engine's warm-up: through
an engine without LoRA, and through one with `max_loras=4` where every request uses the
base model, the same adapter, or one of four adapters in turn. Each case runs
`--reps` times, alternating, and reports its best; the ratios are over the base model
alone. A LoRA engine's products cost `max_loras * max_lora_rank` columns in every
target layer whatever the batch mixes (`jvllm/lora/punica.py`): the result also gives
those FLOPs per token against the base model's matmuls, a figure no load can disturb.

    python bench/lora.py
    python bench/lora.py --preset tiny --num-prompts 4 --max-tokens 8 --reps 1
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common

CASES = ("base_alone", "lora_0_adapters", "lora_1_adapter", "lora_4_adapters")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(common.PRESETS), default="cpu")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "lora.json")
    return p.parse_args(argv)


def make_adapters(base: Path, rank: int) -> list[Path]:
    """Four random adapters beside the checkpoint, written once per rank."""
    from jvllm.testing.lora_adapters import make_peft_adapter

    paths = []
    for i in range(4):
        out = base.parent / f"{base.name}-lora-r{rank}-{i}"
        if not (out / "adapter_model.safetensors").exists():
            make_peft_adapter(base, out, rank=rank, seed=i, scale=0.05)
        paths.append(out)
    return paths


def timed(llm: Any, batch: list[dict], loras: list[Any] | None, max_tokens: int) -> float:
    """Output tokens per second of one generate over the batch."""
    from jvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(batch) * max_tokens
    return tokens / seconds


def run_cases(args: argparse.Namespace, path: Path, adapters: list[Path]) -> dict[str, Any]:
    from jvllm import LLM, LoRARequest

    preset = common.PRESETS[args.preset]
    rng = np.random.default_rng(0)
    shape = (args.num_prompts, args.prompt_len)
    prompts = rng.integers(len(common.SPECIAL_TOKENS), preset.vocab_size, shape)
    batch = [{"prompt_token_ids": [int(t) for t in row]} for row in prompts]
    requests = [LoRARequest(f"lora{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    engine = dict(
        max_model_len=args.prompt_len + args.max_tokens,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=max(256, args.prompt_len),
        enable_prefix_caching=False,  # every case computes its whole prompts
    )
    mixes = {
        "lora_0_adapters": None,
        "lora_1_adapter": [requests[0]] * len(batch),
        "lora_4_adapters": [requests[i % 4] for i in range(len(batch))],
    }
    rates: dict[str, list[float]] = {case: [] for case in CASES}
    base = LLM(str(path), **engine)
    lora = LLM(str(path), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **engine)
    warm = batch[:4]
    for llm, loras in ((base, None), *((lora, mix) for mix in mixes.values())):
        llm.generate(warm, use_tqdm=False, lora_request=loras and loras[:4])
    compiled = {"base": base.get_metrics()["num_compilations"]}
    compiled["lora"] = lora.get_metrics()["num_compilations"]
    for rep in range(args.reps):
        common.log(f"rep {rep + 1} of {args.reps}")
        rates["base_alone"].append(timed(base, batch, None, args.max_tokens))
        for case, loras in mixes.items():
            rates[case].append(timed(lora, batch, loras, args.max_tokens))
    new = base.get_metrics()["num_compilations"] - compiled["base"]
    new += lora.get_metrics()["num_compilations"] - compiled["lora"]
    return dict(rates=rates, new_compilations=new)


def flops_per_token(preset: common.Preset, max_loras: int, rank: int) -> dict[str, float]:
    """Matmul FLOPs a token costs: the base model's linear layers and lm_head, and the
    LoRA products of `max_loras` slots of rank `rank` on every target (whatever the mix)."""
    h, inter, d = preset.hidden_size, preset.intermediate_size, preset.head_dim
    q, kv = preset.num_heads * d, preset.num_kv_heads * d
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    base = preset.num_layers * sum(2 * i * o for i, o in shapes) + 2 * h * preset.vocab_size
    lora = preset.num_layers * sum(2 * max_loras * rank * (i + o) for i, o in shapes)
    return dict(base=float(base), lora=float(lora), lora_fraction=lora / base)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    path = common.build_checkpoint(common.PRESETS[args.preset], args.models_dir)
    adapters = make_adapters(path, args.rank)
    measured = run_cases(args, path, adapters)
    best = {case: max(r) for case, r in measured["rates"].items()}
    result.update(
        preset=args.preset,
        workload=dict(
            num_prompts=args.num_prompts,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            lora_rank=args.rank,
            max_loras=4,
        ),
        output_tok_s=best,
        output_tok_s_every_rep=measured["rates"],
        ratio_over_base_alone={case: best[case] / best["base_alone"] for case in CASES},
        new_compilations=measured["new_compilations"],
        matmul_flops_per_token=flops_per_token(common.PRESETS[args.preset], 4, args.rank),
        note="shared 2-core machine: wall-clock figures are noisy; best of the reps",
    )
    rows = [[c, best[c], result["ratio_over_base_alone"][c]] for c in CASES]
    print(common.format_table(["case", "output tok/s", "ratio over base alone"], rows))
    print(f"LoRA products: {result['matmul_flops_per_token']['lora_fraction']:.1%} of the FLOPs")
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()

"""`jvllm compare MODEL`: jvllm's greedy outputs against Transformers' on one checkpoint,
as a table, exiting 1 on a real divergence (vLLM's near-tie rule, `compare.py`).

Owns the subcommand's flags, reading a prompts file, running both runners one after
the other (the Transformers model is freed before the engine starts, so a GPU holds one
at a time) and the table. The rule and the failure message are `compare.py`'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jvllm.config import DTYPES
from jvllm.testing.compare import EXAMPLE_PROMPTS, Divergence, compare_logprobs


def add_compare_parser(commands: Any) -> None:
    """The `compare` subcommand on `jvllm`'s subparsers."""
    compare = commands.add_parser(
        "compare",
        help="compare greedy outputs and logprobs with Transformers on a checkpoint",
        description="Run MODEL's greedy continuations of some prompts with Transformers and "
        "with jvllm, print a table, and exit 1 where they diverge beyond a near-tie (each "
        "side's token among the other's top-k logprobs).",
    )
    compare.add_argument("model", help="Hugging Face checkpoint directory")
    compare.add_argument("--prompts", help="text file, one prompt a line (default: 8 built in)")
    compare.add_argument("--dtype", choices=(*DTYPES, "half", "float"), default="auto")
    compare.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt")
    compare.add_argument("--num-logprobs", type=int, default=5, help="top-k of the near-tie rule")
    compare.add_argument(
        "--reference", help="Transformers checkpoint to compare with (default: MODEL)"
    )
    compare.add_argument("--tensor-parallel-size", type=int, default=1)
    compare.add_argument("--max-model-len", type=int, default=None)
    compare.add_argument("--max-num-seqs", type=int, default=None)
    compare.add_argument("--max-num-batched-tokens", type=int, default=None)


def read_prompts(path: str | None) -> list[str]:
    """The file's non-empty lines, or the built-in prompts without a file."""
    if path is None:
        return list(EXAMPLE_PROMPTS)
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--prompts {path!r}: no such file")
    prompts = [line for line in file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path!r} holds no prompt (one per non-empty line)")
    return prompts


def _side(d: Divergence | None, side: int, width: int = 10) -> tuple[str, ...]:
    """(token, its text, its logprob on each side) of one side at a divergence."""
    if d is None or d.tokens[side] is None:
        return ("", "", "", "")
    token, text = d.tokens[side], repr(d.token_texts[side] or "")[:width]
    return (str(token), text, *(_lp(d.logprobs[k], token) for k in (0, 1)))


def _lp(logprobs: dict[int, float] | None, token: int | None) -> str:
    if logprobs is None or token is None:
        return ""
    return f"{logprobs[token]:.3f}" if token in logprobs else "<top-k"


def format_table(
    prompts: Sequence[str], ref: Sequence[Any], got: Sequence[Any], found: Sequence[Divergence]
) -> str:
    """One row per prompt: lengths, equal prefix, verdict, and each side's token at the
    first difference with its logprob under Transformers (hf) and jvllm."""
    by_prompt = {d.prompt_index: d for d in found}
    head = ("#", "hf", "jvllm", "equal", "verdict", "hf tok", "text", "lp hf", "lp jv",
            "jvllm tok", "text", "lp hf", "lp jv", "prompt")  # fmt: skip
    rows = [head]
    for i, prompt in enumerate(prompts):
        d = by_prompt.get(i)
        n_ref, n_got = len(ref[i][0]), len(got[i][0])
        verdict = "match" if d is None else "near-tie" if d.near_tie else "DIVERGED"
        equal = str(min(n_ref, n_got) if d is None else d.position)
        rows.append((str(i), str(n_ref), str(n_got), equal, verdict,
                     *_side(d, 0), *_side(d, 1), repr(prompt)[:40]))  # fmt: skip
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def run_compare(args: argparse.Namespace) -> int:
    """The `jvllm compare` command: 0 when every prompt matches or diverges at a near-tie,
    1 on a real divergence."""
    from jvllm.testing.jvllm_runner import JvllmRunner, ask_for_host_devices

    ask_for_host_devices(args.tensor_parallel_size)  # before anything starts JAX
    try:
        from jvllm.testing.hf_runner import HfRunner
    except ImportError as e:
        raise ValueError(f"jvllm compare needs torch: pip install 'jvllm[test]' ({e})") from e

    prompts = read_prompts(args.prompts)
    if args.max_tokens < 1 or args.num_logprobs < 1:
        raise ValueError(
            f"--max-tokens and --num-logprobs must be >= 1, got {args.max_tokens} and "
            f"{args.num_logprobs}"
        )
    with HfRunner(args.reference or args.model, dtype=args.dtype) as hf:
        ref = hf.generate_greedy_logprobs(prompts, args.max_tokens, args.num_logprobs)
    engine = {
        k: getattr(args, k) for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
    }
    engine = {k: v for k, v in engine.items() if v is not None}
    with JvllmRunner(
        args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size, **engine
    ) as jv:
        got = jv.generate_greedy_logprobs(prompts, args.max_tokens, args.num_logprobs)
    found = compare_logprobs(ref, got, "hf", "jvllm")
    print(format_table(prompts, ref, got, found))
    real = [d for d in found if not d.near_tie]
    for d in real:
        print("\n" + d.message())
    near = len(found) - len(real)
    print(f"\n{len(prompts)} prompts: {len(prompts) - len(found)} equal, {near} near-ties, "
          f"{len(real)} diverged")  # fmt: skip
    return 1 if real else 0

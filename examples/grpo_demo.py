"""A GRPO-style loop with jvllm as the rollout engine, on the demo model, in one process.

    python examples/grpo_demo.py --steps 3 [--dtype bfloat16] [--json out.json]

Each step: jvllm samples `--group` completions of each prompt with the sampled tokens'
logprobs; a reward scores them (a finished cookie is worth 1, each token costs 0.02);
the trainer recomputes the same logprobs with a plain JAX forward
(`jvllm.demo.train.forward`: no paged KV cache, no code shared with the engine's model)
on the parameters the engine holds, then takes one optax step on GRPO's clipped
objective with group-normalised advantages, and `LLM.update_weights` pushes the new
parameters into the engine as (Hugging Face name, jax array) pairs: no recompilation,
the prefix cache reset. Per step it reports max |rollout logprob - trainer logprob|,
rollout tokens/s and the update's time; the next step's rollouts come from the updated
engine, so the logprob check also checks the update.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jvllm import LLM, SamplingParams
from jvllm.demo import demo_model_path
from jvllm.demo.export import _LAYER_NAMES
from jvllm.demo.train import forward
from jvllm.demo.train_eagle import load_target

PROMPTS = ["Love is", "Never trust", "The best way to", "A man"]
CLIP = 0.2  # PPO/GRPO ratio clipping


def hf_pairs(params: dict[str, jax.Array]) -> list[tuple[str, jax.Array]]:
    """The trainer's parameters (layers stacked, linear weights [in, out]) as Hugging Face
    (name, array) pairs, [out, in]; they stay jax arrays on the trainer's device."""
    pairs = [("model.embed_tokens.weight", params["embed"]), ("model.norm.weight", params["norm"])]
    for key, hf in _LAYER_NAMES.items():
        for n in range(params[key].shape[0]):
            w = params[key][n]
            pairs.append((f"model.layers.{n}.{hf}", w.T if w.ndim == 2 else w))
    return pairs


def token_logprobs(params: dict, tokens: jax.Array, dtype: Any) -> jax.Array:
    """[B, T-1]: log p(tokens[:, t+1] | tokens[:, :t+1]) in float32, the forward in `dtype`."""
    cast = jax.tree.map(lambda x: x.astype(dtype), params)
    logits = forward(cast, tokens[:, :-1]).astype(jnp.float32)  # [B, T-1, V]
    logp = jax.nn.log_softmax(logits, -1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]


def grpo_loss(
    params: dict,
    tokens: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T-1]: 1 on completion tokens
    old_logp: jax.Array,  # [B, T-1]: the rollout's logprobs
    advantages: jax.Array,  # [B]
    dtype: Any,
) -> jax.Array:
    """GRPO's clipped surrogate over the completion tokens."""
    logp = token_logprobs(params, tokens, dtype)
    ratio = jnp.exp(logp - old_logp)
    adv = advantages[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv)
    return -jnp.sum(surrogate * mask) / jnp.sum(mask)


def rollout_batch(outs: list, width: int, pad: int) -> dict[str, np.ndarray]:
    """Prompt + completion rows padded to `width`, the completion mask and the engine's
    logprob of each completion token, aligned with `token_logprobs`' [B, T-1]."""
    rows = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
    tokens = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width - 1), np.float32)
    logp = np.zeros((len(rows), width - 1), np.float32)
    rewards = np.zeros(len(rows), np.float32)
    for i, (prompt, c) in enumerate(rows):
        ids = [*prompt, *c.token_ids]
        tokens[i, : len(ids)] = ids
        start = len(prompt) - 1  # position t predicts token t + 1
        mask[i, start : start + len(c.token_ids)] = 1
        logp[i, start : start + len(c.token_ids)] = [
            pos[tok].logprob for pos, tok in zip(c.logprobs, c.token_ids, strict=True)
        ]
        rewards[i] = (c.finish_reason == "stop") - 0.02 * len(c.token_ids)
    return {"tokens": tokens, "mask": mask, "logp": logp, "rewards": rewards}


def advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """Each reward less its group's mean, over the group's standard deviation."""
    r = rewards.reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    llm = LLM(
        str(demo_model_path()),
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=256,
        max_num_seqs=len(PROMPTS) * args.group,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    params = load_target(demo_model_path())  # float32 master weights, the trainer's
    llm.update_weights(hf_pairs(params))  # the engine runs exactly what the trainer holds
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(params)
    grad_fn = jax.jit(jax.value_and_grad(grpo_loss), static_argnums=5)
    logp_fn = jax.jit(token_logprobs, static_argnums=2)
    sampling = SamplingParams(
        n=args.group, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=args.seed
    )
    pad = llm.get_tokenizer().pad_token_id or 0
    width = max(len(llm.get_tokenizer().encode(p)) for p in PROMPTS) + args.max_tokens + 1
    compiled, steps = None, []
    for step in range(args.steps):
        start = time.perf_counter()
        outs = llm.generate(PROMPTS, sampling, use_tqdm=False)
        rollout_s = time.perf_counter() - start
        compiled = compiled or llm.get_metrics()["num_compilations"]
        batch = rollout_batch(outs, width, pad)
        trainer_logp = logp_fn(params, jnp.asarray(batch["tokens"]), dtype)
        diff = np.abs(np.asarray(trainer_logp) - batch["logp"]) * batch["mask"]
        adv = jnp.asarray(advantages(batch["rewards"], args.group))
        inputs = (jnp.asarray(batch["tokens"]), jnp.asarray(batch["mask"]))
        loss, grads = grad_fn(params, *inputs, jnp.asarray(batch["logp"]), adv, dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        jax.block_until_ready(params)
        start = time.perf_counter()
        llm.update_weights(hf_pairs(params))
        update_s = time.perf_counter() - start
        steps.append(
            {
                "step": step,
                "max_abs_logprob_diff": float(diff.max()),
                "mean_reward": float(batch["rewards"].mean()),
                "loss": float(loss),
                "rollout_tokens": int(batch["mask"].sum()),
                "rollout_tokens_per_s": float(batch["mask"].sum() / rollout_s),
                "update_weights_s": update_s,
            }
        )
        print(json.dumps(steps[-1]))
    return {
        "dtype": args.dtype,
        "steps": steps,
        "max_abs_logprob_diff": max(s["max_abs_logprob_diff"] for s in steps),
        "num_compilations": {
            "after_first_rollout": compiled,
            "end": llm.get_metrics()["num_compilations"],
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args(argv)
    summary = run(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()

"""Trains Medusa draft heads for the demo model, on the CPU.

    python -m jvllm.demo.train_medusa --out jvllm/demo/medusa

Owns the heads' math for training (per head one residual block `x + SiLU(x W + b)` on the
target's post-norm feature, then the head's own vocabulary projection, initialised from
the target's tied embedding), self-distillation on the demo corpus (head i at position
t learns the frozen target's next-token distribution at position t + 1 + i, which the
target computes for each batch on the fly: the heads learn to guess what the target
would say, not the corpus), and the export to vLLM's Medusa layout (config.json,
bfloat16 `model.safetensors`, `training.json`). Shares no code with the serving model's
Medusa module, so the engine's heads are checked against an independent computation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jvllm.demo import corpus
from jvllm.demo.eagle_math import target_features
from jvllm.demo.train import CONTEXT, held_out_batches, make_optimizer, training_windows
from jvllm.demo.train_eagle import TARGET_DIR, load_corpus, load_target

MEDUSA_DIR = Path(__file__).resolve().parent / "medusa"
NUM_HEADS = 3


def heads_logits(heads: dict, feats: Any) -> Any:
    """[K, B, T, V] logits of every head from the target's features [B, T, H]."""
    import jax
    import jax.numpy as jnp

    x = feats[None] + jax.nn.silu(
        jnp.einsum("bti,kio->kbto", feats, heads["w"]) + heads["b"][:, None, None]
    )
    return jnp.einsum("kbth,kvh->kbtv", x, heads["lm"])


def head_terms(heads: dict, target: dict, tokens: Any, mask: Any) -> dict[str, Any]:
    """Per head, sums over valid positions: distillation cross-entropy and top-1 hits
    against the target's greedy token, and the count of positions."""
    import jax
    import jax.numpy as jnp

    feats = target_features(target, tokens)  # [B, T, H]
    teacher = jax.lax.stop_gradient(feats @ target["embed"].T)  # [B, T, V]
    logits = heads_logits(heads, feats)
    out: dict[str, Any] = {"ce": [], "top1": [], "count": []}
    t = tokens.shape[1]
    for i in range(heads["w"].shape[0]):
        # Head i at position p guesses the target's token after position p + 1 + i.
        span = t - 1 - i
        p = jax.nn.softmax(teacher[:, 1 + i :], -1)
        logp = jax.nn.log_softmax(logits[i, :, :span], -1)
        m = mask[:, :span] * mask[:, 1 + i :]
        out["ce"].append(jnp.sum(-jnp.sum(p * logp, -1) * m))
        hits = jnp.argmax(logp, -1) == jnp.argmax(teacher[:, 1 + i :], -1)
        out["top1"].append(jnp.sum(hits * m))
        out["count"].append(jnp.sum(m))
    return {k: jnp.stack(v) for k, v in out.items()}


def train_loss(heads: dict, target: dict, tokens: Any) -> Any:
    import jax.numpy as jnp

    terms = head_terms(heads, target, tokens, jnp.ones(tokens.shape, jnp.float32))
    return jnp.sum(terms["ce"] / terms["count"])


def init_heads(target: dict, num_heads: int) -> dict[str, Any]:
    """Zero blocks (each head starts as the target's own scoring) on the tied embedding."""
    import jax.numpy as jnp

    v, h = target["embed"].shape
    return {
        "w": jnp.zeros((num_heads, h, h), jnp.float32),  # [head, in, out]
        "b": jnp.zeros((num_heads, h), jnp.float32),
        "lm": jnp.broadcast_to(target["embed"], (num_heads, v, h)).copy(),
    }


def evaluate(eval_fn: Any, heads: dict, target: dict, held: list[list[int]], pad: int) -> dict:
    total: dict[str, np.ndarray] = {}
    for tokens, mask in held_out_batches(held, pad, 32):
        for k, v in eval_fn(heads, target, tokens, mask).items():
            total[k] = total.get(k, 0) + np.asarray(v)
    return {
        "ce": [round(float(x), 4) for x in total["ce"] / total["count"]],
        "top1": [round(float(x), 4) for x in total["top1"] / total["count"]],
    }


def write_heads(out: Path, heads: dict[str, Any], report: dict[str, Any]) -> None:
    import ml_dtypes
    from safetensors.numpy import save_file

    bf16 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))
    tensors = {}
    for i in range(heads["w"].shape[0]):
        tensors[f"blocks.{i}.layers.0.weight"] = bf16(np.asarray(heads["w"][i]).T)
        tensors[f"blocks.{i}.layers.0.bias"] = bf16(heads["b"][i])
        tensors[f"lm_heads.{i}.weight"] = bf16(heads["lm"][i])
    target_config = json.loads((TARGET_DIR / "config.json").read_text())
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": target_config["hidden_size"],
        "vocab_size": target_config["vocab_size"],
        "num_heads": int(heads["w"].shape[0]),
        "num_hidden_layers": 1,
        "medusa_fc_bias": True,
        "torch_dtype": "bfloat16",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


def train(out: Path, steps: int, batch: int, seed: int, lr: float) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm

    tok, stream, held = load_corpus()
    target = load_target()
    heads = init_heads(target, NUM_HEADS)
    opt = make_optimizer(lr, steps)
    opt_state = opt.init(heads)
    eval_fn = jax.jit(head_terms)

    @jax.jit
    def step(heads, opt_state, tokens):
        value, grads = jax.value_and_grad(train_loss)(heads, target, tokens)
        updates, opt_state = opt.update(grads, opt_state, heads)
        return optax.apply_updates(heads, updates), opt_state, value

    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for _ in (bar := tqdm(range(steps), desc="train", unit="step")):
        tokens = training_windows(rng, stream, batch)
        heads, opt_state, loss = step(heads, opt_state, tokens)
        bar.set_postfix(loss=f"{float(loss):.4f}")
    minutes = (time.perf_counter() - started) / 60
    shipped = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), heads)
    report = {
        "target": "jvllm/demo/model",
        "method": "Medusa-1 heads, self-distilled (cross-entropy to the target's distribution)",
        "corpus": f"Debian packages fortunes, fortunes-min ({corpus.INSTALL_COMMAND})",
        "train_tokens": int(stream.size),
        "steps": steps,
        "batch": batch,
        "context": CONTEXT,
        "seed": seed,
        "learning_rate": lr,
        "num_heads": NUM_HEADS,
        "train_minutes": round(minutes, 1),
        "held_out": evaluate(eval_fn, shipped, target, held, tok.pad_token_id),
        "held_out_notes": "per head i (the token i + 2 after the feature's position): "
        "mean cross-entropy to the target's distribution, and how often the head's argmax "
        "equals the target's greedy token",
    }
    write_heads(out, heads, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jvllm.demo.train_medusa", description=__doc__)
    parser.add_argument("--out", default=str(MEDUSA_DIR), help="heads directory to write")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    report = train(Path(args.out), args.steps, args.batch, args.seed, args.lr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

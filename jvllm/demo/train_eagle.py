"""Trains an EAGLE-1 draft head for the demo model, on the CPU.

    python -m jvllm.demo.train_eagle --out jvllm/demo/eagle    # ~25 minutes on 1 core
    python -m jvllm.demo.train_eagle --verify                  # ~10 s: JAX vs Transformers

Owns the head's math for training (fc over [embedding of t_{i+1}, target feature h_i],
one Llama decoder layer without its input norm, no final norm; the target's tied
embedding scores it), the teacher-forced loop on the demo corpus (the frozen target
computes its post-norm features for each batch on the fly), the EAGLE-1 loss (smooth-L1
to h_{i+1} plus 0.1 soft-label cross-entropy against the target's next-token
distribution), the export to the public EAGLE-1 checkpoint layout (config.json,
bfloat16 `model.safetensors`, `training.json`) and `--verify`, which checks the exported
head against Transformers' `LlamaDecoderLayer` on a held-out sequence. Like train.py it
shares no code with the serving model, so the engine's head is checked against an
independent one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jvllm.demo import corpus
from jvllm.demo.eagle_math import (
    head_forward,
    head_second_step,
    target_features,
)
from jvllm.demo.export import _LAYER_NAMES
from jvllm.demo.train import (
    _LAYER_KEYS,
    CONTEXT,
    MODEL_SHAPE,
    encode_examples,
    held_out_batches,
    init_params,
    make_optimizer,
    training_windows,
)

DEMO_DIR = Path(__file__).resolve().parent
TARGET_DIR = DEMO_DIR / "model"
EAGLE_DIR = DEMO_DIR / "eagle"
NOISE = 0.05  # EAGLE's uniform noise on the input features while training
CE_WEIGHT = 0.1
_HEAD_LAYER_KEYS = tuple(k for k in _LAYER_KEYS if k != "ln1")


# --- losses and metrics -----------------------------------------------------------------


def huber(pred: Any, teacher: Any) -> Any:
    """Smooth-L1 with delta 1, mean over the hidden axis."""
    import jax.numpy as jnp

    diff = jnp.abs(pred - teacher)
    return jnp.mean(jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), -1)


def position_terms(g: Any, teacher: Any, embed: Any) -> dict[str, Any]:
    """Per-position [B, T] loss terms and top-1 hits of predicted features g against the
    teacher features h_{i+1}."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(g @ embed.T, -1)
    teacher_logits = teacher @ embed.T
    teacher_logp = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits, -1))
    teacher_p = jnp.exp(teacher_logp)
    ce = -jnp.sum(teacher_p * logp, -1)
    return {
        "smooth_l1": huber(g, teacher),
        "ce": ce,
        "kl": ce + jnp.sum(teacher_p * teacher_logp, -1),
        "top1": (jnp.argmax(logp, -1) == jnp.argmax(teacher_logits, -1)).astype(jnp.float32),
    }


def train_loss(head: dict, embed: Any, feats: Any, tokens: Any, mask: Any, key: Any) -> Any:
    """EAGLE-1's loss over the valid positions, inputs h plus uniform noise."""
    import jax
    import jax.numpy as jnp

    noisy = feats[:, :-1] + jax.random.uniform(key, feats[:, :-1].shape, jnp.float32, -NOISE, NOISE)
    g = head_forward(head, embed, tokens[:, 1:], noisy)
    terms = position_terms(g, feats[:, 1:], embed)
    m = mask[:, 1:]
    return jnp.sum((terms["smooth_l1"] + CE_WEIGHT * terms["ce"]) * m) / jnp.sum(m)


def eval_sums(head: dict, target: dict, tokens: Any, mask: Any) -> dict[str, Any]:
    """Sums over the valid positions of one held-out batch: loss terms and top-1 hits for
    the first draft step, top-1 hits of the second (and of both) and the counts."""
    import jax.numpy as jnp

    embed = target["embed"]
    feats = target_features(target, tokens)
    next_tokens, m = tokens[:, 1:], mask[:, 1:]
    g = head_forward(head, embed, next_tokens, feats[:, :-1])
    one = position_terms(g, feats[:, 1:], embed)
    g2 = head_second_step(head, embed, next_tokens, feats[:, :-1], g)
    two = position_terms(g2, feats[:, 1:], embed)["top1"]
    m2 = m.at[:, 0].set(0.0)
    both = two * jnp.concatenate([jnp.zeros_like(one["top1"][:, :1]), one["top1"][:, :-1]], 1)
    sums = {k: jnp.sum(v * m) for k, v in one.items()}
    sums.update(top1_step2=jnp.sum(two * m2), top1_both=jnp.sum(both * m2))
    sums.update(count=jnp.sum(m), count2=jnp.sum(m2))
    return sums


def evaluate(eval_fn: Any, head: dict, target: dict, held: list[list[int]], pad: int) -> dict:
    """Held-out loss terms (means per position) and top-1 accuracies."""
    total: dict[str, float] = {}
    for tokens, mask in held_out_batches(held, pad, 32):
        for k, v in eval_fn(head, target, tokens, mask).items():
            total[k] = total.get(k, 0.0) + float(v)
    n, n2 = total["count"], total["count2"]
    out = {k: total[k] / n for k in ("smooth_l1", "ce", "kl", "top1")}
    out["loss"] = out["smooth_l1"] + CE_WEIGHT * out["ce"]
    out["top1_step2"] = total["top1_step2"] / n2
    # A second draft only counts once the first is accepted: both right, per position.
    out["top1_both"] = total["top1_both"] / n2
    return {k: round(v, 4) for k, v in out.items()}


# --- checkpoints ------------------------------------------------------------------------


def load_target(path: Path = TARGET_DIR) -> dict[str, Any]:
    """The demo checkpoint in train.py's layout (layers stacked on [L], linear weights
    [in, out]), in float32."""
    import jax.numpy as jnp
    from safetensors.flax import load_file

    raw = {k: v.astype(jnp.float32) for k, v in load_file(str(path / "model.safetensors")).items()}
    n = MODEL_SHAPE["num_hidden_layers"]
    params = {"embed": raw["model.embed_tokens.weight"], "norm": raw["model.norm.weight"]}
    for name, hf in _LAYER_NAMES.items():
        ws = [raw[f"model.layers.{i}.{hf}"] for i in range(n)]
        params[name] = jnp.stack([w.T if w.ndim == 2 else w for w in ws])
    return params


def init_head(rng: np.random.Generator, vocab: int) -> dict[str, Any]:
    """fc small normal; the layer as train.py initialises its layers; post norm 1."""
    import jax.numpy as jnp

    full = init_params(rng, vocab)
    h = MODEL_SHAPE["hidden_size"]
    fc = (rng.standard_normal((2 * h, h)) * 0.02).astype(np.float32)
    layer = {k: jnp.asarray(full[k][0]) for k in _HEAD_LAYER_KEYS}
    return {"fc": jnp.asarray(fc), "layer": layer}


def head_tensors(head: dict[str, Any]) -> dict[str, np.ndarray]:
    """EAGLE-1 names, [out, in] layout, bfloat16."""
    import ml_dtypes

    def bf16(x: Any) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))

    tensors = {"fc.weight": bf16(np.asarray(head["fc"]).T)}
    for k in _HEAD_LAYER_KEYS:
        w = np.asarray(head["layer"][k])
        tensors[f"layers.0.{_LAYER_NAMES[k]}"] = bf16(w.T if w.ndim == 2 else w)
    return tensors


def load_head(path: Path = EAGLE_DIR) -> dict[str, Any]:
    """An exported head back in training layout, float32."""
    import jax.numpy as jnp
    from safetensors.flax import load_file

    raw = {k: v.astype(jnp.float32) for k, v in load_file(str(path / "model.safetensors")).items()}
    layer = {}
    for k in _HEAD_LAYER_KEYS:
        w = raw[f"layers.0.{_LAYER_NAMES[k]}"]
        layer[k] = w.T if w.ndim == 2 else w
    return {"fc": raw["fc.weight"].T, "layer": layer}


def eagle_config(target_config: dict[str, Any]) -> dict[str, Any]:
    """A one-layer Llama config with the target's shape, as EAGLE-1 checkpoints carry."""
    copied = (
        "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
        "vocab_size max_position_embeddings rms_norm_eps rope_theta hidden_act"
    ).split()
    config: dict[str, Any] = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama"}
    config.update({k: target_config[k] for k in copied[:2]})
    config["num_hidden_layers"] = 1
    config.update({k: target_config[k] for k in copied[2:]})
    config.update(tie_word_embeddings=False, torch_dtype="bfloat16")
    config.update({k: target_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    return config


def write_head(out: Path, head: dict[str, Any], report: dict[str, Any]) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((TARGET_DIR / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(eagle_config(target_config), indent=2) + "\n")
    save_file(head_tensors(head), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


# --- data -------------------------------------------------------------------------------


def load_corpus() -> tuple[Any, np.ndarray, list[list[int]]]:
    """(tokenizer, the training token stream, held-out examples), as train.py made them."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(TARGET_DIR))
    train_cookies, held_cookies = corpus.split(corpus.read_cookies(corpus.fortune_files()))
    stream = np.array([t for e in encode_examples(tok, train_cookies) for t in e], np.int32)
    return tok, stream, encode_examples(tok, held_cookies)


# --- training ---------------------------------------------------------------------------


def train(out: Path, steps: int, batch: int, seed: int, lr: float) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm

    tok, stream, held = load_corpus()
    target = load_target()
    embed = target["embed"]
    rng = np.random.default_rng(seed)
    head = init_head(rng, embed.shape[0])
    opt = make_optimizer(lr, steps)
    opt_state = opt.init(head)
    eval_fn = jax.jit(eval_sums)

    @jax.jit
    def step(head, opt_state, tokens, key):
        feats = target_features(target, tokens)
        mask = jnp.ones(tokens.shape, jnp.float32)
        value, grads = jax.value_and_grad(train_loss)(head, embed, feats, tokens, mask, key)
        updates, opt_state = opt.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, value

    key = jax.random.key(seed)
    started, eval_seconds = time.perf_counter(), 0.0
    bar = tqdm(range(steps), desc="train", unit="step")
    for i in bar:
        tokens = training_windows(rng, stream, batch)
        key, sub = jax.random.split(key)
        head, opt_state, loss = step(head, opt_state, tokens, sub)
        bar.set_postfix(loss=f"{float(loss):.4f}")
        if (i + 1) % max(steps // 4, 1) == 0 and i + 1 < steps:
            eval_started = time.perf_counter()
            held_eval = evaluate(eval_fn, head, target, held, tok.pad_token_id)
            bar.write(f"step {i + 1}: held-out {held_eval}")
            eval_seconds += time.perf_counter() - eval_started
    minutes = (time.perf_counter() - started - eval_seconds) / 60  # training alone
    # As for the target, what counts is the head as shipped, rounded to bfloat16.
    shipped = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), head)
    held_eval = evaluate(eval_fn, shipped, target, held, tok.pad_token_id)
    report = {
        "target": "jvllm/demo/model",
        "method": "EAGLE-1 (smooth-L1 on features + 0.1 soft-label cross-entropy)",
        "corpus": f"Debian packages fortunes, fortunes-min ({corpus.INSTALL_COMMAND})",
        "train_tokens": int(stream.size),
        "held_out_positions": int(sum(min(len(e), CONTEXT + 1) - 1 for e in held)),
        "steps": steps,
        "batch": batch,
        "context": CONTEXT,
        "seed": seed,
        "learning_rate": lr,
        "feature_noise": NOISE,
        "parameters": int(sum(np.prod(p.shape) for p in jax.tree.leaves(head))),
        "train_minutes": round(minutes, 1),
        "seconds_per_step": round(minutes * 60 / steps, 2),
        "held_out": held_eval,
        "held_out_notes": (
            "means over held-out positions; top1: argmax of the head's logits equals the "
            "target's greedy next token; top1_step2: the same for a second draft fed the "
            "head's own previous feature instead of the target's (real token ids); "
            "top1_both: both drafts right"
        ),
    }
    write_head(out, head, report)
    return report


# --- verification against Transformers --------------------------------------------------


def verify(path: Path = EAGLE_DIR) -> dict[str, Any]:
    """The exported head in JAX (float32 from its bf16 weights) against a Transformers
    LlamaDecoderLayer (input norm replaced by Identity) and Linear on one held-out
    sequence, the target's features from LlamaForCausalLM in both cases."""
    import jax.numpy as jnp
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    tok, _, held = load_corpus()
    ids = np.array(max(held[:32], key=len)[: CONTEXT + 1], np.int32)
    t = len(ids) - 1

    model = LlamaForCausalLM.from_pretrained(str(TARGET_DIR), torch_dtype=torch.float32).eval()
    config = LlamaConfig(**json.loads((path / "config.json").read_text()))
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    tensors = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in tensors.items() if k != "fc.weight"}
    )
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.weight.data = tensors["fc.weight"]
    layer.eval()
    with torch.no_grad():
        x_ids = torch.from_numpy(ids.astype(np.int64))[None]
        h_t = model(x_ids, output_hidden_states=True).hidden_states[-1]
        embed_t = model.get_input_embeddings().weight
        x = fc(torch.cat([embed_t[x_ids[:, 1:]], h_t[:, :-1]], -1))
        pos = torch.arange(t)[None]
        cos_sin = LlamaRotaryEmbedding(config)(x, pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        g_t = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        g_t = g_t[0] if isinstance(g_t, tuple) else g_t
    g_torch, h_torch = g_t[0].numpy(), h_t[0].numpy()

    target, head = load_target(), load_head(path)
    tokens = jnp.asarray(ids)[None]
    h_jax = target_features(target, tokens)
    g_jax = np.asarray(head_forward(head, target["embed"], tokens[:, 1:], h_jax[:, :-1])[0])
    # The head alone, fed Transformers' features, isolates it from the target's rounding.
    g_same = head_forward(head, target["embed"], tokens[:, 1:], jnp.asarray(h_torch)[None, :-1])
    g_same = np.asarray(g_same[0])
    e = np.asarray(target["embed"])

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

    top_torch = np.argmax(g_torch @ e.T, -1)
    result = {
        "positions": t,
        "target_h_rel_err": rel(np.asarray(h_jax[0]), h_torch),
        "head_g_rel_err": rel(g_jax, g_torch),
        "head_g_rel_err_same_input": rel(g_same, g_torch),
        "top1_agreement": float(np.mean(np.argmax(g_jax @ e.T, -1) == top_torch)),
        "torch_head_top1_vs_target": float(np.mean(top_torch == np.argmax(h_torch[1:] @ e.T, -1))),
    }
    result["ok"] = result["head_g_rel_err"] < 1e-3 and result["top1_agreement"] > 0.99
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jvllm.demo.train_eagle", description=__doc__)
    parser.add_argument("--out", default=str(EAGLE_DIR), help="head directory to write")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16, help="sequences of CONTEXT+1 tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--verify", action="store_true", help="check --out against Transformers")
    args = parser.parse_args(argv)
    if args.verify:
        result = verify(Path(args.out))
        print(json.dumps(result, indent=2))
        return 0 if result["ok"] else 1
    report = train(Path(args.out), args.steps, args.batch, args.seed, args.lr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Trains an EAGLE-3 draft head for the demo model, on the CPU.

    python -m jvllm.demo.train_eagle3 --out jvllm/demo/eagle3    # ~15 minutes on 2 cores

Owns the head's math for training, the draft vocabulary, the loss and the export to the
public EAGLE-3 layout vLLM's `Eagle3LlamaForCausalLM` reads (config.json with
`draft_vocab_size` and `eagle_aux_hidden_state_layer_ids`, bfloat16 `model.safetensors`
with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t` and `t2d`, and `training.json`).

The head fuses the inputs of target layers AUX_LAYERS (the residual stream before each)
with `fc` [3H -> H]; its decoder layer attends over [input_layernorm(embedding of
t_{i+1}), hidden_norm(fused)] (q, k, v read 2H), adds the attention to the fused feature,
runs its MLP, and its output (before the final norm) is both what `norm` and `lm_head`
score over the draft vocabulary and the feature fed back for the next draft. Training
unrolls two draft steps (EAGLE-3's training-time test, shortened): step 1 from the
target's features, step 2 from the head's own step-1 output at the previous position,
attending to step 1's keys before it; each step's loss is the cross-entropy to the
frozen target's next-token distribution over the draft vocabulary. The draft vocabulary
is the DRAFT_VOCAB most frequent tokens of the training stream. Shares no code with the
serving model (`jvllm.models.eagle3`), so the engine's head is checked against an
independent one.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from jvllm.demo import corpus
from jvllm.demo.eagle_math import causal_attention, decoder_layer, mlp, rms, rope, rope_tables
from jvllm.demo.train import (
    _LAYER_KEYS,
    CONTEXT,
    MODEL_SHAPE,
    held_out_batches,
    make_optimizer,
    training_windows,
)
from jvllm.demo.train_eagle import TARGET_DIR, load_corpus, load_target

EAGLE3_DIR = Path(__file__).resolve().parent / "eagle3"
AUX_LAYERS = (1, 2, 3)  # low, mid, high of the demo's 4 layers (vLLM reads 0..N-1)
DRAFT_VOCAB = 2048
STEP2_WEIGHT = 0.5


def aux_features(target: dict, tokens: Any) -> tuple[Any, Any]:
    """The inputs of target layers AUX_LAYERS concatenated [B, T, 3H], and the target's
    next-token logits [B, T, V]."""
    import jax.numpy as jnp

    cos, sin = rope_tables(tokens.shape[1])
    x, aux = target["embed"][tokens], []
    for n in range(target["wq"].shape[0]):
        if n in AUX_LAYERS:
            aux.append(x)
        x = decoder_layer({k: target[k][n] for k in _LAYER_KEYS}, x, cos, sin)
    return jnp.concatenate(aux, -1), rms(x, target["norm"]) @ target["embed"].T


def _qkv(p: dict, e: Any, f: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
    """Rotated q [B, T, Nq, D], k and v repeated to Nq heads, over [norm(e); norm(f)]."""
    import jax.numpy as jnp

    nq, nk, d = (MODEL_SHAPE[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    y = jnp.concatenate([rms(e, p["ln_embed"]), rms(f, p["ln_hidden"])], -1)
    b, t = y.shape[:2]
    q = rope((y @ p["wq"]).reshape(b, t, nq, d), cos, sin)
    k = jnp.repeat(rope((y @ p["wk"]).reshape(b, t, nk, d), cos, sin), nq // nk, 2)
    v = jnp.repeat((y @ p["wv"]).reshape(b, t, nk, d), nq // nk, 2)
    return q, k, v


def head_step1(head: dict, e: Any, fused: Any) -> tuple[Any, Any, Any]:
    """Step 1 at every position: output features [B, T, H] and the keys, values."""
    cos, sin = rope_tables(e.shape[1])
    q, k, v = _qkv(head, e, fused, cos, sin)
    a = fused + causal_attention(q, k, v) @ head["wo"]
    return a + mlp(head, a), k, v


def head_step2(head: dict, e: Any, prev: Any, k: Any, v: Any) -> Any:
    """Step 2 at every position j >= 1: the feature is the head's own step-1 output at
    j - 1; it attends to step 1's keys at 0..j-1 and to itself. Row 0 is meaningless."""
    import jax
    import jax.numpy as jnp

    b, t = e.shape[:2]
    cos, sin = rope_tables(t)
    q2, k2, v2 = _qkv(head, e, prev, cos, sin)
    d = q2.shape[-1]
    before = jnp.einsum("btnd,bsnd->bnts", q2, k) / math.sqrt(d)
    before = jnp.where(jnp.tril(jnp.ones((t, t), bool), -1), before, -1e30)
    own = jnp.einsum("btnd,btnd->bnt", q2, k2)[..., None] / math.sqrt(d)
    w = jax.nn.softmax(jnp.concatenate([before, own], -1), -1)
    attn = jnp.einsum("bnts,bsnd->btnd", w[..., :t], v) + w[..., t:].transpose(0, 2, 1, 3) * v2
    a = prev + attn.reshape(b, t, -1) @ head["wo"]
    return a + mlp(head, a)


def step_terms(head: dict, target: dict, ids: Any, tokens: Any, mask: Any) -> dict[str, Any]:
    """Per draft step, sums over valid positions: cross-entropy to the target's
    distribution restricted to the draft vocabulary `ids`, top-1 hits against the target's
    greedy token, and counts. Position i drafts the target's token after t_{i+1}."""
    import jax
    import jax.numpy as jnp

    aux, logits = aux_features(target, tokens)
    aux, teacher = jax.lax.stop_gradient(aux[:, :-1]), jax.lax.stop_gradient(logits[:, 1:])
    e = target["embed"][tokens[:, 1:]]
    fused = aux @ head["fc"]
    g1, k, v = head_step1(head, e, fused)
    prev = jnp.concatenate([jnp.zeros_like(g1[:, :1]), g1[:, :-1]], 1)
    g2 = head_step2(head, e, prev, k, v)
    p = jax.nn.softmax(teacher[..., ids], -1)
    greedy = jnp.argmax(teacher, -1)
    m = mask[:, 1:]
    m2 = m.at[:, 0].set(0.0)
    out: dict[str, Any] = {"ce": [], "top1": [], "count": []}
    for g, mm in ((g1, m), (g2, m2)):
        logp = jax.nn.log_softmax(rms(g, head["norm"]) @ head["lm"].T, -1)
        out["ce"].append(jnp.sum(-jnp.sum(p * logp, -1) * mm))
        out["top1"].append(jnp.sum((ids[jnp.argmax(logp, -1)] == greedy) * mm))
        out["count"].append(jnp.sum(mm))
    return {k: jnp.stack(v) for k, v in out.items()}


def train_loss(head: dict, target: dict, ids: Any, tokens: Any) -> Any:
    import jax.numpy as jnp

    terms = step_terms(head, target, ids, tokens, jnp.ones(tokens.shape, jnp.float32))
    ce = terms["ce"] / terms["count"]
    return ce[0] + STEP2_WEIGHT * ce[1]


def draft_vocabulary(stream: np.ndarray, vocab: int) -> np.ndarray:
    """The DRAFT_VOCAB most frequent token ids of the stream (ties: lower id), ascending."""
    counts = np.bincount(stream, minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))
    return np.sort(order[:DRAFT_VOCAB]).astype(np.int32)


def init_head(rng: np.random.Generator, target: dict, ids: np.ndarray) -> dict[str, Any]:
    """Small normal weights, unit norms; fc passes the highest aux layer through; lm_head
    starts as the target's tied embedding rows of the draft vocabulary."""
    import jax.numpy as jnp

    h, i = MODEL_SHAPE["hidden_size"], MODEL_SHAPE["intermediate_size"]
    d = MODEL_SHAPE["head_dim"]
    q, kv = MODEL_SHAPE["num_attention_heads"] * d, MODEL_SHAPE["num_key_value_heads"] * d
    normal = lambda *s, scale=0.02: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
    fc = np.zeros((3 * h, h), np.float32)
    fc[2 * h :] = np.eye(h, dtype=np.float32)
    ones = lambda: jnp.ones(h, jnp.float32)
    return {
        "fc": jnp.asarray(fc) + normal(3 * h, h, scale=0.002),
        "ln_embed": ones(),
        "ln_hidden": ones(),
        "wq": normal(2 * h, q),
        "wk": normal(2 * h, kv),
        "wv": normal(2 * h, kv),
        "wo": normal(q, h, scale=0.01),
        "ln2": ones(),
        "w_gate": normal(h, i),
        "w_up": normal(h, i),
        "w_down": normal(i, h, scale=0.01),
        "norm": jnp.asarray(target["norm"]),
        "lm": jnp.asarray(target["embed"])[ids],
    }


# training name -> EAGLE-3 checkpoint name ([out, in] for matrices)
_NAMES = {
    "fc": "fc.weight",
    "ln_embed": "midlayer.input_layernorm.weight",
    "ln_hidden": "midlayer.hidden_norm.weight",
    "wq": "midlayer.self_attn.q_proj.weight",
    "wk": "midlayer.self_attn.k_proj.weight",
    "wv": "midlayer.self_attn.v_proj.weight",
    "wo": "midlayer.self_attn.o_proj.weight",
    "ln2": "midlayer.post_attention_layernorm.weight",
    "w_gate": "midlayer.mlp.gate_proj.weight",
    "w_up": "midlayer.mlp.up_proj.weight",
    "w_down": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm": "lm_head.weight",
}


def head_config(target_config: dict[str, Any]) -> dict[str, Any]:
    """A one-layer Llama config of the target's shape with EAGLE-3's fields."""
    copied = (
        "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
        "vocab_size max_position_embeddings rms_norm_eps rope_theta hidden_act "
        "bos_token_id eos_token_id pad_token_id"
    ).split()
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}
    config.update({k: target_config[k] for k in copied})
    config.update(num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB, tie_word_embeddings=False)
    config.update(eagle_aux_hidden_state_layer_ids=list(AUX_LAYERS), torch_dtype="bfloat16")
    return config


def write_head(out: Path, head: dict[str, Any], ids: np.ndarray, report: dict) -> None:
    import ml_dtypes
    from safetensors.numpy import save_file

    bf16 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))
    tensors = {}
    for k, name in _NAMES.items():
        w = np.asarray(head[k])
        tensors[name] = bf16(w.T if w.ndim == 2 and k != "lm" else w)
    target_config = json.loads((TARGET_DIR / "config.json").read_text())
    vocab = target_config["vocab_size"]
    tensors["d2t"] = (ids.astype(np.int64) - np.arange(len(ids))).astype(np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head_config(target_config), indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


def evaluate(eval_fn: Any, head: dict, target: dict, ids: Any, held: list, pad: int) -> dict:
    total: dict[str, np.ndarray] = {}
    for tokens, mask in held_out_batches(held, pad, 32):
        for k, v in eval_fn(head, target, ids, tokens, mask).items():
            total[k] = total.get(k, 0) + np.asarray(v)
    return {
        "ce": [round(float(x), 4) for x in total["ce"] / total["count"]],
        "top1": [round(float(x), 4) for x in total["top1"] / total["count"]],
    }


def train(out: Path, steps: int, batch: int, seed: int, lr: float) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm

    tok, stream, held = load_corpus()
    target = load_target()
    ids_np = draft_vocabulary(stream, target["embed"].shape[0])
    ids = jnp.asarray(ids_np)
    rng = np.random.default_rng(seed)
    head = init_head(rng, target, ids_np)
    opt = make_optimizer(lr, steps)
    opt_state = opt.init(head)
    eval_fn = jax.jit(step_terms)

    @jax.jit
    def step(head, opt_state, tokens):
        value, grads = jax.value_and_grad(train_loss)(head, target, ids, tokens)
        updates, opt_state = opt.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, value

    started = time.perf_counter()
    for _ in (bar := tqdm(range(steps), desc="train", unit="step", mininterval=10)):
        tokens = training_windows(rng, stream, batch)
        head, opt_state, loss = step(head, opt_state, tokens)
        bar.set_postfix(loss=f"{float(loss):.4f}")
    minutes = (time.perf_counter() - started) / 60
    shipped = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), head)
    report = {
        "target": "jvllm/demo/model",
        "method": "EAGLE-3 head, two-step training-time test, cross-entropy to the target",
        "corpus": f"Debian packages fortunes, fortunes-min ({corpus.INSTALL_COMMAND})",
        "train_tokens": int(stream.size),
        "draft_vocab_size": DRAFT_VOCAB,
        "draft_vocab_coverage": round(float(np.isin(stream, ids_np).mean()), 4),
        "aux_layers": list(AUX_LAYERS),
        "steps": steps,
        "batch": batch,
        "context": CONTEXT,
        "seed": seed,
        "learning_rate": lr,
        "parameters": int(sum(np.prod(p.shape) for p in jax.tree.leaves(head))),
        "train_minutes": round(minutes, 1),
        "held_out": evaluate(eval_fn, shipped, target, ids, held, tok.pad_token_id),
        "held_out_notes": "per draft step (1: from the target's features, 2: from the "
        "head's own previous output): mean cross-entropy to the target's distribution over "
        "the draft vocabulary, and how often the head's argmax equals the target's greedy token",
    }
    write_head(out, head, ids_np, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jvllm.demo.train_eagle3", description=__doc__)
    parser.add_argument("--out", default=str(EAGLE3_DIR), help="head directory to write")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8, help="sequences of CONTEXT+1 tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    report = train(Path(args.out), args.steps, args.batch, args.seed, args.lr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

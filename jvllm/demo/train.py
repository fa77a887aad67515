"""Trains the demo model: a small Llama on Debian's fortune cookies, on the CPU.

    python -m jvllm.demo.train --out DIR        # under an hour on 2 cores

Owns the tokenizer training, the token stream, a plain (unpaged) Llama forward for
training, the optax loop and the export to a Hugging Face checkpoint directory
(config.json, bfloat16 safetensors, tokenizer files, the corpus word list and a
`training.json` of provenance). It shares no code with the serving model on purpose:
the parity tests then check jvllm's paged forward against an independent one (and
against Transformers, which loads the export).
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
from jvllm.demo.export import write_checkpoint
from jvllm.demo.tokenizer import chat_ids, train_tokenizer

# A few million parameters: small enough to train here in well under an hour, large
# enough to write English.
MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
VOCAB_SIZE = 4096
CONTEXT = 256
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
# Fraction of examples taught as plain text (for /v1/completions) instead of a chat turn.
PLAIN_PERCENT = 30
_LAYER_KEYS = ("ln1", "ln2", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def encode_examples(tok: Any, cookies: list[str]) -> list[list[int]]:
    """Token ids of each cookie: a chat turn, or for PLAIN_PERCENT of them plain text."""
    out = []
    for i, example in enumerate(corpus.examples(cookies)):
        if i % 100 < PLAIN_PERCENT:
            ids = [tok.bos_token_id, *tok.encode(example.answer, add_special_tokens=False)]
            out.append([*ids, tok.eos_token_id])
        else:
            out.append(chat_ids(tok, example.prompt, example.answer))
    return out


def init_params(rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """Layer weights stacked on a leading [L] axis; linear weights are [in, out]."""
    h, i, d = MODEL_SHAPE["hidden_size"], MODEL_SHAPE["intermediate_size"], MODEL_SHAPE["head_dim"]
    n = MODEL_SHAPE["num_hidden_layers"]
    q, kv = MODEL_SHAPE["num_attention_heads"] * d, MODEL_SHAPE["num_key_value_heads"] * d

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out_scale = 0.02 / math.sqrt(2 * n)  # residual branches start small (GPT-2's scaling)
    return {
        "embed": normal(vocab, h),
        "norm": np.ones(h, np.float32),
        "ln1": np.ones((n, h), np.float32),
        "ln2": np.ones((n, h), np.float32),
        "wq": normal(n, h, q),
        "wk": normal(n, h, kv),
        "wv": normal(n, h, kv),
        "wo": normal(n, q, h, scale=out_scale),
        "w_gate": normal(n, h, i),
        "w_up": normal(n, h, i),
        "w_down": normal(n, i, h, scale=out_scale),
    }


def forward(params: dict, tokens: Any) -> Any:
    """Logits [B, T, V] of a causal Llama over tokens [B, T] (tied embeddings)."""
    import jax
    import jax.numpy as jnp

    nq, nk, d = (MODEL_SHAPE[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    b, t = tokens.shape
    inv_freq = 1.0 / ROPE_THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq  # [T, D/2]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    causal = jnp.tril(jnp.ones((t, t), bool))

    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + RMS_EPS) * w

    def rope(x):  # [B, T, N, D], HF's rotate-half layout
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def attention(q, k, v):  # [B, T, N, D] each, k and v repeated to Nq heads
        q, k, v = (z.transpose(0, 2, 1, 3) for z in (q, k, v))
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(d)
        s = jnp.where(causal, s, -1e30)
        a = jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)
        return a.transpose(0, 2, 1, 3).reshape(b, t, nq * d)

    x = params["embed"][tokens]
    # A Python loop, not lax.scan: XLA:CPU runs the unrolled backward about twice as fast.
    for n in range(params["wq"].shape[0]):
        p = {k: params[k][n] for k in _LAYER_KEYS}
        y = rms(x, p["ln1"])
        q = rope((y @ p["wq"]).reshape(b, t, nq, d))
        k = jnp.repeat(rope((y @ p["wk"]).reshape(b, t, nk, d)), nq // nk, 2)
        v = jnp.repeat((y @ p["wv"]).reshape(b, t, nk, d), nq // nk, 2)
        x = x + attention(q, k, v) @ p["wo"]
        y = rms(x, p["ln2"])
        x = x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]
    return rms(x, params["norm"]) @ params["embed"].T


def token_losses(params: dict, tokens: Any, mask: Any) -> tuple[Any, Any]:
    """(sum of next-token cross-entropy over mask, number of masked targets)."""
    import jax
    import jax.numpy as jnp

    logits = forward(params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    m = mask[:, 1:]
    return jnp.sum(nll * m), jnp.sum(m)


def training_windows(rng: np.random.Generator, stream: np.ndarray, batch: int) -> np.ndarray:
    """`batch` random windows of CONTEXT + 1 tokens of the training stream `[B, C + 1]`."""
    starts = rng.integers(0, len(stream) - CONTEXT - 1, batch)
    return np.stack([stream[s : s + CONTEXT + 1] for s in starts])


def held_out_batches(examples: list[list[int]], pad: int, batch: int):
    """Each held-out example alone in a row (truncated to the context), padded."""
    for start in range(0, len(examples), batch):
        rows = [e[: CONTEXT + 1] for e in examples[start : start + batch]]
        tokens = np.full((batch, CONTEXT + 1), pad, np.int32)
        mask = np.zeros((batch, CONTEXT + 1), np.float32)
        for r, ids in enumerate(rows):
            tokens[r, : len(ids)] = ids
            mask[r, : len(ids)] = 1.0
        yield tokens, mask


def evaluate(loss_fn: Any, params: dict, examples: list[list[int]], pad: int) -> float:
    """Mean next-token loss in nats over every held-out target token."""
    total, count = 0.0, 0.0
    for tokens, mask in held_out_batches(examples, pad, 32):
        s, c = loss_fn(params, tokens, mask)
        total, count = total + float(s), count + float(c)
    return total / count


def make_optimizer(lr: float, steps: int) -> Any:
    """AdamW (b2 0.95, weight decay 0.1) with a linear warm-up and a cosine decay to lr / 10,
    gradients clipped to norm 1."""
    import optax

    warmup = min(100, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * 0.1)
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1)
    )


def train(out: Path, steps: int, batch: int, seed: int, lr: float) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm

    cookies = corpus.read_cookies(corpus.fortune_files())
    train_cookies, held_cookies = corpus.split(cookies)
    tok = train_tokenizer(out, train_cookies, VOCAB_SIZE)
    stream = np.array([t for e in encode_examples(tok, train_cookies) for t in e], np.int32)
    held = encode_examples(tok, held_cookies)
    pad = tok.pad_token_id
    rng = np.random.default_rng(seed)
    params = jax.tree.map(jnp.asarray, init_params(rng, len(tok)))
    opt = make_optimizer(lr, steps)
    opt_state = opt.init(params)
    eval_loss = jax.jit(token_losses)

    @jax.jit
    def step(params, opt_state, tokens):
        def loss(p):
            s, c = token_losses(p, tokens, jnp.ones(tokens.shape, jnp.float32))
            return s / c

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    started = time.perf_counter()
    bar = tqdm(range(steps), desc="train", unit="step")
    for i in bar:
        tokens = training_windows(rng, stream, batch)
        params, opt_state, loss = step(params, opt_state, tokens)
        # A sync each step keeps the bar's rate true; a step is seconds long, so it is free.
        bar.set_postfix(loss=f"{float(loss):.3f}")
        if (i + 1) % max(steps // 4, 1) == 0 and i + 1 < steps:
            bar.write(f"step {i + 1}: held-out loss {evaluate(eval_loss, params, held, pad):.4f}")
    minutes = (time.perf_counter() - started) / 60
    # The loss that counts is that of the weights as shipped, rounded to bfloat16.
    shipped = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), params)
    held_loss = evaluate(eval_loss, shipped, held, pad)
    report = {
        "corpus": f"Debian packages fortunes, fortunes-min ({corpus.INSTALL_COMMAND})",
        "licence": "BSD (fortune-mod's data files)",
        "cookies": {"train": len(train_cookies), "held_out": len(held_cookies)},
        "train_tokens": int(stream.size),
        "held_out_tokens": int(sum(len(e) - 1 for e in held)),
        "steps": steps,
        "batch": batch,
        "context": CONTEXT,
        "seed": seed,
        "learning_rate": lr,
        "parameters": int(sum(np.prod(p.shape) for p in jax.tree.leaves(params))),
        "train_minutes": round(minutes, 1),
        "held_out_loss": round(held_loss, 4),
        "held_out_perplexity": round(math.exp(held_loss), 2),
    }
    write_checkpoint(out, params, hf_config(tok), report, corpus.words(cookies))
    return report


def hf_config(tok: Any) -> dict[str, Any]:
    """Transformers' LlamaConfig fields of the trained model (tied embeddings)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL_SHAPE,
        "vocab_size": len(tok),
        "max_position_embeddings": 4 * CONTEXT,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "jvllm_demo": True,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jvllm.demo.train", description=__doc__)
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=24, help="sequences of CONTEXT+1 tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    report = train(Path(args.out), args.steps, args.batch, args.seed, args.lr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

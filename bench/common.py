"""What every benchmark shares: model presets, random checkpoints, workloads, FLOP counts
and the result files.

Owns the Llama-shaped presets and where their random-weight checkpoints are cached
(`jvllm.testing.checkpoints` writes them: numpy + safetensors straight in the target
dtype, no torch), the
ShareGPT-shaped request lengths, the FLOP and byte counts behind the roofline figures,
the in-process matmul and copy yardsticks, and the JSON envelope (exact command line,
machine load) that every result file carries. It runs no engine: each script measures
its own thing.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jvllm.testing.checkpoints import WORD_SPECIAL_TOKENS, write_random_llama, write_word_tokenizer

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DEFAULT_MODELS_DIR = Path(
    os.environ.get("JVLLM_BENCH_MODELS", Path.home() / ".cache" / "jvllm" / "bench-models")
)

# vLLM paper (Kwon et al. 2023): ShareGPT averages 161 input and 338 output tokens;
# vLLM's ShareGPT loader drops prompts over 1024 tokens and pairs over 2048.
SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 161.3, 338.0
SHAREGPT_MAX_INPUT, SHAREGPT_MAX_TOTAL = 1024, 2048
MIN_LEN = 4  # shorter prompts or completions are dropped, as vLLM does
# Lognormal shape (sigma of log-length): heavy right tails, medians below the means.
SIGMA_INPUT, SIGMA_OUTPUT = 1.0, 0.8

SPECIAL_TOKENS = WORD_SPECIAL_TOKENS  # ids 0..3; words follow
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
_STAMP = "bench_preset.json"


@dataclass(frozen=True)
class Preset:
    """A Llama-shaped model and the engine sizes it is benchmarked with."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_model_len: int
    dtype: str  # "float32" or "bfloat16"
    length_scale: float  # ShareGPT means and caps are multiplied by this
    num_prompts: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int | None  # shared by paged and static; None sizes from free memory
    hf_batch_sizes: tuple[int, ...]
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self) -> dict[str, Any]:
        return dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_model_len,
            rope_theta=self.rope_theta,
            rms_norm_eps=1e-5,
            hidden_act="silu",
            tie_word_embeddings=False,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            dtype=self.dtype,
        )


PRESETS: dict[str, Preset] = {
    # Seconds: CI's smoke test. Lengths 1/16 of ShareGPT's.
    "tiny": Preset("tiny", 64, 128, 2, 4, 2, 512, 128, "float32", 1 / 16, 8, 8, 64, 33, (4,)),
    # ~36M parameters in float32 (Llama-3 ratios: GQA 4:1, MLP 3.5x; vocab cut to 8192).
    # Lengths 1/8 of ShareGPT's; 257 blocks = 16 static sequences of max_model_len.
    "cpu": Preset("cpu", 512, 1792, 8, 8, 2, 8192, 256, "float32", 1 / 8, 256, 128, 512, 257,
                  (8, 16, 32)),
    # Llama-3-8B's shapes in bfloat16, full ShareGPT lengths; the cache fills free memory.
    "8b": Preset("8b", 4096, 14336, 32, 32, 8, 128256, 2048, "bfloat16", 1.0, 1000, 256, 8192,
                 None, (16, 32, 64)),
}  # fmt: skip


# -- checkpoints ---------------------------------------------------------------------------


def build_checkpoint(preset: Preset, models_dir: Path = DEFAULT_MODELS_DIR) -> Path:
    """The preset's checkpoint directory, written once and reused while the preset matches."""
    out = Path(models_dir) / preset.name
    stamp = json.dumps(asdict(preset) | {"format": 1}, sort_keys=True)
    if (out / _STAMP).exists() and (out / _STAMP).read_text() == stamp:
        return out
    partial = out.with_name(out.name + ".partial")
    for stale in (out, partial):
        shutil.rmtree(stale, ignore_errors=True)
    partial.mkdir(parents=True)
    started = time.perf_counter()
    write_word_tokenizer(partial, preset.vocab_size)
    write_random_llama(partial, preset.hf_config())
    (partial / _STAMP).write_text(stamp)
    partial.rename(out)
    print(f"wrote the {preset.name} checkpoint to {out} in {time.perf_counter() - started:.1f} s")
    return out


# -- workloads -----------------------------------------------------------------------------


class BenchRequest(NamedTuple):
    prompt_token_ids: list[int]
    output_len: int


def length_caps(preset: Preset) -> tuple[int, int]:
    """(longest prompt, longest prompt + output): vLLM's ShareGPT filter, scaled."""
    max_total = min(round(SHAREGPT_MAX_TOTAL * preset.length_scale), preset.max_model_len)
    return min(round(SHAREGPT_MAX_INPUT * preset.length_scale), max_total - MIN_LEN), max_total


def synthetic_workload(preset: Preset, num_prompts: int, seed: int) -> list[BenchRequest]:
    """Seeded lognormal lengths scaled to ShareGPT's means times `length_scale`,
    clipped to the scaled caps; prompt ids are random non-special tokens."""
    rng = np.random.default_rng(seed)
    max_in, max_total = length_caps(preset)

    def draw(mean: float, sigma: float) -> np.ndarray:
        raw = rng.lognormal(0.0, sigma, num_prompts)
        return np.maximum(np.rint(raw * mean / raw.mean()), MIN_LEN).astype(int)

    inputs = np.minimum(draw(SHAREGPT_MEAN_INPUT * preset.length_scale, SIGMA_INPUT), max_in)
    outputs = draw(SHAREGPT_MEAN_OUTPUT * preset.length_scale, SIGMA_OUTPUT)
    outputs = np.minimum(outputs, max_total - inputs)
    low = len(SPECIAL_TOKENS)
    return [
        BenchRequest(rng.integers(low, preset.vocab_size, int(n)).tolist(), int(m))
        for n, m in zip(inputs, outputs, strict=True)
    ]


def sharegpt_workload(
    path: Path, preset: Preset, num_prompts: int, seed: int, tokenizer: Any
) -> list[BenchRequest]:
    """Requests from a ShareGPT JSON file: first human turn as the prompt, the reply's
    token count as the output length, vLLM's length filter (scaled); ids beyond the
    model's vocabulary are folded into it."""
    import random

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset {path}: expected a list of {{'conversations': [...]}}")
    pairs = [
        (d["conversations"][0]["value"], d["conversations"][1]["value"])
        for d in data
        if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    max_in, max_total = length_caps(preset)
    low, span = len(SPECIAL_TOKENS), preset.vocab_size - len(SPECIAL_TOKENS)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        n_out = len(tokenizer.encode(reply, add_special_tokens=False))
        if len(ids) < MIN_LEN or n_out < MIN_LEN or len(ids) > max_in:
            continue
        if len(ids) + n_out > max_total:
            continue
        out.append(BenchRequest([low + t % span for t in ids], n_out))
        if len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"--dataset {path}: no conversation passes the length filter")
    return out


def make_workload(
    preset: Preset, seed: int, dataset: Path | None, tokenizer_path: str
) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The preset's `num_prompts` requests, synthetic or from a ShareGPT file, described."""
    if dataset is None:
        requests = synthetic_workload(preset, preset.num_prompts, seed)
        source = f"synthetic ShareGPT-shaped lognormal lengths, seed {seed}"
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        requests = sharegpt_workload(dataset, preset, preset.num_prompts, seed, tokenizer)
        source = f"ShareGPT file {dataset}, seed {seed}"
    return requests, describe_workload(preset, requests, source)


def describe_workload(preset: Preset, requests: Sequence[BenchRequest], source: str) -> dict:
    ins = np.array([len(r.prompt_token_ids) for r in requests])
    outs = np.array([r.output_len for r in requests])
    max_in, max_total = length_caps(preset)
    return dict(
        source=source,
        num_requests=len(requests),
        length_scale=preset.length_scale,
        target_mean_input=round(SHAREGPT_MEAN_INPUT * preset.length_scale, 1),
        target_mean_output=round(SHAREGPT_MEAN_OUTPUT * preset.length_scale, 1),
        mean_input=float(ins.mean()),
        mean_output=float(outs.mean()),
        median_input=float(np.median(ins)),
        median_output=float(np.median(outs)),
        max_input_cap=max_in,
        max_total_cap=max_total,
        total_input_tokens=int(ins.sum()),
        total_output_tokens=int(outs.sum()),
    )


# -- FLOPs, bytes and the yardsticks ---------------------------------------------------------


@dataclass(frozen=True)
class FlopModel:
    """Useful FLOPs: 2 x (layer matmul params) per token computed, 2 x (lm_head params)
    per token sampled, and 4 x heads x head_dim per (query, visible key) pair for QK^T
    and PV. Norms, rotary, softmax and the embedding gather are not counted."""

    linear_params: int  # per token, all layers: q, k, v, o, gate, up, down
    lm_head_params: int
    attn_per_key: int  # 4 * num_heads * head_dim
    weight_bytes: int  # every parameter but the embedding table, read once per step
    kv_bytes_per_token: int  # K and V of one position, all layers

    @classmethod
    def from_preset(cls, p: Preset) -> FlopModel:
        h, d, itemsize = p.hidden_size, p.head_dim, 4 if p.dtype == "float32" else 2
        per_layer = h * d * (2 * p.num_heads + 2 * p.num_kv_heads) + 3 * h * p.intermediate_size
        linear = p.num_layers * per_layer
        return cls(
            linear_params=linear,
            lm_head_params=p.vocab_size * h,
            attn_per_key=4 * p.num_heads * d,
            weight_bytes=(linear + p.vocab_size * h) * itemsize,
            kv_bytes_per_token=2 * p.num_layers * p.num_kv_heads * d * itemsize,
        )

    def chunk(self, start: int, num_tokens: int, samples: bool) -> float:
        """FLOPs of computing positions start..start+num_tokens-1 of one sequence."""
        first, last = start + 1, start + num_tokens  # keys visible to the first/last query
        keys = (first + last) * num_tokens / 2
        lm_head = 2 * self.lm_head_params if samples else 0
        return 2.0 * self.linear_params * num_tokens + self.attn_per_key * keys + lm_head

    def request(self, prompt_len: int, output_len: int) -> float:
        """Every token but the last sampled one is computed; output_len tokens are sampled."""
        computed = prompt_len + output_len - 1
        return self.chunk(0, computed, False) + 2.0 * self.lm_head_params * output_len

    def workload(self, requests: Sequence[BenchRequest]) -> float:
        return sum(self.request(len(r.prompt_token_ids), r.output_len) for r in requests)


def measure_matmul(dtype: str, n: int, reps: int = 5) -> dict[str, float]:
    """Best-of-reps FLOP/s of one n x n x n matmul, in JAX and (on CPU) torch."""
    import jax
    import jax.numpy as jnp

    jdt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    a = jax.random.normal(jax.random.key(0), (n, n), jdt)
    b = jax.random.normal(jax.random.key(1), (n, n), jdt)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    out = {
        "n": n,
        "dtype": dtype,
        "jax_flops": _best_rate(lambda: mm(a, b).block_until_ready(), 2.0 * n**3, reps),
    }
    if jax.default_backend() == "cpu":
        import torch

        ta, tb = torch.randn(n, n), torch.randn(n, n)
        torch.matmul(ta, tb)
        out["torch_flops"] = _best_rate(lambda: torch.matmul(ta, tb), 2.0 * n**3, reps)
    out["peak_flops"] = max(v for k, v in out.items() if k.endswith("_flops"))
    return out


def measure_copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Best-of-reps bytes/s of a jitted read-and-write of an nbytes float32 array."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    scale = jax.jit(lambda v: v * 2.0)
    scale(x).block_until_ready()
    return _best_rate(lambda: scale(x).block_until_ready(), 2.0 * nbytes, reps)


def _best_rate(fn: Any, work: float, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / best


def enable_compilation_cache(cache_dir: Path) -> int:
    """Turns on JAX's persistent cache for every program (call before any computation);
    returns how many entries it already held (0: this run starts cold)."""
    import jax

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    # By default small or quick compiles are skipped; a small model's are both.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return sum(1 for _ in cache_dir.iterdir())


# -- results -------------------------------------------------------------------------------


def envelope(script: str, argv: Sequence[str]) -> dict[str, Any]:
    """Where a result came from: the exact command, the commit, the machine and its load."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return dict(
        benchmark=Path(script).stem,
        command=shlex.join(["python", f"bench/{Path(script).name}", *argv]),
        started_at=datetime.datetime.now().isoformat(timespec="seconds"),
        git=commit,
        host=dict(
            platform=platform.platform(),
            python=platform.python_version(),
            cpu_count=os.cpu_count(),
            loadavg_start=[round(x, 2) for x in os.getloadavg()],
        ),
    )


def write_result(path: Path, result: dict[str, Any]) -> Path:
    result["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats get 4 significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.3e}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, text)])


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def demo_chat_llm(model: str | None, num_prompts: int) -> tuple[Any, str, list[list[int]]]:
    """An engine on `model` (default: the demo model with its engine defaults), its
    path, and `num_prompts` chat prompts from the demo corpus as token ids."""
    from jvllm import LLM
    from jvllm.demo import DEMO_ENGINE_DEFAULTS, demo_model_path
    from jvllm.demo.corpus import PROMPTS

    path = model or str(demo_model_path())
    llm = LLM(path, **DEMO_ENGINE_DEFAULTS) if model is None else LLM(path)
    tokenizer = llm.get_tokenizer()
    prompts = []
    for i in range(num_prompts):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return llm, path, prompts

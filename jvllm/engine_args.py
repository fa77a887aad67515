"""EngineArgs: every engine knob in one place, and `create_engine()` that wires them.

Owns turning user arguments into validated configs, loading the checkpoint and
tokenizer, sizing the KV cache, building and warming up the model runner, and
handing all of it to the host-only `LLMEngine`. The CLI and `LLM` both go
through here, so their flags and keyword arguments stay the same.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from jvllm.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from jvllm.demo import with_shipped_head
from jvllm.draft_models import check_draft_length, load_draft
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.multimodal import MultiModalProcessor, media_domains
from jvllm.engine.scheduling.scheduler import check_kv_capacity
from jvllm.engine_resolution import (
    check_cpu_offload,
    compilation_cache,
    resolve_backend,
    resolve_max_model_len,
    resolve_prefix_caching,
)
from jvllm.generation_config import generation_config_dir
from jvllm.kv_offload.setup import attach_fs_tier, host_tier_gib
from jvllm.lora.config import LoRAConfig
from jvllm.models.eagle import load_eagle_head
from jvllm.models.kv_groups import hybrid_sliding_window
from jvllm.models.loader import LoadedModel, load_model
from jvllm.models.medusa import load_medusa_heads
from jvllm.models.weight_layout import process_weights_after_loading, transposes_weights
from jvllm.parallel import step_channel
from jvllm.parallel.distributed import distributed_config
from jvllm.parallel.distributed import initialize as initialize_distributed
from jvllm.parallel.mesh import make_mesh
from jvllm.pooling.factory import PoolingEngine, create_pooling_engine, pooling_task, runner_class
from jvllm.runner import memory, xla_allocator
from jvllm.runner.cpu_binding import bind_cpu_threads
from jvllm.runner.kv_sizing import device_kv_blocks
from jvllm.runner.model_runner import ModelRunner
from jvllm.sampling_params import MAX_LOGPROBS
from jvllm.tokenizer_loading import eos_token_ids, load_tokenizer

logger = logging.getLogger("jvllm")

# KV-cache budget on a CPU backend, which reports no memory statistics.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Under the compilation cache directory: the runner's stored executables (ExecutableStore).
EXECUTABLES_DIR = "executables"


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # "int8" | "fp8": linear weights quantized at load
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    # Mixture-of-experts models: experts split whole over the tensor-parallel devices.
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int | None = None  # with stages; None: one per stage
    scheduling_policy: str = "continuous"
    async_scheduling: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB per device, host memory for preemption_mode="swap"
    kv_offloading_size: float = 0.0  # GiB per device, host tier of the prefix cache
    # The fs tier below the host tier (docs/kv_tiers.md): vLLM's kv_transfer_config
    # (OffloadingConnector, TieringOffloadingSpec) or a directory and its GiB bound.
    kv_transfer_config: dict[str, Any] | None = None
    kv_offload_dir: str | None = None
    kv_offload_dir_size: float = 16.0
    cpu_offload_gb: float = 0.0  # GiB of weights per device kept in host memory
    kv_cache_dtype: str = "auto"  # "fp8" (e4m3), "fp8_e4m3", "fp8_e5m2": one byte a value
    attention_backend: str = "auto"
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES
    # Compiled programs kept between starts (`compilation_cache`): None is $JVLLM_CACHE/xla
    # (~/.cache/jvllm/xla) unless the process configured JAX's cache already; "" turns it off.
    compilation_cache_dir: str | None = None
    # Multi-host (offline API): every process runs the same program; see parallel.distributed.
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # Request defaults and caps (vLLM's names): see jvllm.generation_config.
    generation_config: str = "auto"
    max_logprobs: int = MAX_LOGPROBS
    # Speculative decoding (vLLM's names): {"method": "ngram", "num_speculative_tokens":
    # 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}; see SpeculativeConfig. The
    # older spelling: speculative_model="[ngram]" with num_speculative_tokens and
    # ngram_prompt_lookup_max/min.
    speculative_config: dict[str, Any] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    # The caller's devices (LLM(mesh=...) or devices=[...]; no flag): the engine's mesh.
    devices: Any = field(default=None, metadata={"flag": False})
    enable_lora: bool = False  # LoRA adapters (vLLM's names): see jvllm.lora.config
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # Pooling models (vLLM's names; jvllm.pooling): runner "auto" | "generate" | "pooling",
    # convert "auto" | "embed" | "classify", pooler_config {"pooling_type": "LAST", ...}.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict[str, Any] | None = None
    # Vision-language models (vLLM's name): at most this many images a prompt, {"image": N}.
    limit_mm_per_prompt: dict[str, int] | None = None
    # Domains whose http(s) image URLs may be fetched (vLLM's --allowed-media-domains),
    # separated by commas or spaces; data: URLs always work.
    allowed_media_domains: str | None = None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def speculative(self) -> SpeculativeConfig | None:
        """The SpeculativeConfig of either spelling; ValueError naming a bad field."""
        old = {
            "model": self.speculative_model,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.ngram_prompt_lookup_max,
            "prompt_lookup_min": self.ngram_prompt_lookup_min,
        }
        old = {k: v for k, v in old.items() if v is not None}
        if self.speculative_config is not None and old:
            raise ValueError(
                "give speculative_config or speculative_model/num_speculative_tokens, not both"
            )
        if old and "model" not in old:
            raise ValueError(f"{sorted(old)} need speculative_model (e.g. '[ngram]')")
        value = self.speculative_config if self.speculative_config is not None else old
        if isinstance(value, dict):  # "eagle" / "medusa" on the demo: its shipped head
            value = with_shipped_head(value, self.model)
        return SpeculativeConfig.from_dict(value) if value else None

    def create_engine(self) -> LLMEngine | PoolingEngine:
        if pooling_task(self) is not None:
            return create_pooling_engine(self)
        # The tokenizer loads (Transformers imports torch: seconds) while the runner warms
        # up: warm-up runs in XLA and leaves the interpreter free.
        with ThreadPoolExecutor(1, thread_name_prefix="jvllm-tokenizer") as pool:
            pending_tokenizer = pool.submit(load_tokenizer, self.tokenizer or self.model)
            built = self._build()
            tokenizer = pending_tokenizer.result()
        runner, loaded, config = built.runner, built.loaded, built.config
        gen_dir = generation_config_dir(self.generation_config, self.model)
        eos = eos_token_ids(gen_dir, loaded.spec, tokenizer)
        engine = LLMEngine(
            config,
            tokenizer,
            runner,
            runner.num_blocks,
            loaded.spec.vocab_size,
            eos,
            built.num_host_blocks,
            built.num_tier_blocks,
        )
        attach_fs_tier(engine, runner, self, loaded.dtype)
        if loaded.vision is not None:  # a vision-language model: its own processor
            domains = media_domains(self.allowed_media_domains)
            engine.mm_processor = MultiModalProcessor(self.model, self.limit_mm_per_prompt, domains)
        return engine

    def create_follower_runner(self) -> ModelRunner:
        """A multi-host follower's side: the model runner alone, warmed up, no engine
        (`ModelRunner.follow` runs the leader's programs)."""
        return self._build().runner

    def _build(self) -> _Built:
        # Before anything starts JAX's backend (LLM and `jvllm serve` call it earlier).
        xla_allocator.configure_allocator(self.gpu_memory_utilization)
        bind_cpu_threads()  # JVLLM_CPU_THREADS_BIND: XLA's compute cores, Python's
        check_cpu_offload(self.cpu_offload_gb)
        speculative, lora = self.speculative(), LoRAConfig.from_args(self)
        model_config = ModelConfig(
            self.model, self.dtype, self.max_model_len, self.seed, self.attention_backend
        )
        dist = distributed_config(self.coordinator_address, self.num_processes, self.process_id)
        if dist is not None:
            initialize_distributed(dist)
        cache_dir = compilation_cache(self.compilation_cache_dir)
        parallel = ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.pipeline_micro_batches,
            self.enable_expert_parallel,
        )
        if parallel.pipeline_parallel_size > 1:
            self._check_pipeline(speculative)
        mesh = None
        if parallel.world_size > 1 or self.devices is not None:
            tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
            mesh = make_mesh(tp, self.devices, pipeline_parallel_size=pp)
        backend = resolve_backend(self.attention_backend)
        offload = int(self.cpu_offload_gb * memory.GIB)
        loaded = load_model(
            self.model,
            self.dtype,
            backend,
            mesh,
            self.quantization,
            offload,
            expert_parallel=parallel.enable_expert_parallel,
            max_model_len=self.max_model_len,
        )
        if loaded.vision is not None and dist is not None:  # followers get no image embeddings
            raise ValueError(f"{loaded.spec.architecture} is not supported on several hosts yet")
        if transposes_weights(loaded.spec, mesh, loaded.num_offloaded_layers):
            loaded = process_weights_after_loading(loaded)
        logger.info(
            "Model weights: %.1f MiB (quantization: %s)",
            loaded.weight_bytes / 2**20,
            self.quantization or "none",
        )
        if self.cpu_offload_gb:
            logger.info(
                "cpu_offload_gb=%s: the first %d of %d decoder layers keep their weights in "
                "host memory",
                self.cpu_offload_gb,
                loaded.num_offloaded_layers,
                loaded.spec.num_layers,
            )
        max_model_len = resolve_max_model_len(self.max_model_len, loaded.spec)
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            tokenizer = self.tokenizer or self.model
            draft = load_draft(
                speculative.model, self.dtype, backend, mesh, loaded, max_model_len, tokenizer
            )
        elif speculative is not None and speculative.method in ("eagle", "eagle3", "deepseek_mtp"):
            head = speculative.model or self.model  # an MTP layer: the target's own by default
            draft = load_eagle_head(head, loaded, backend, mesh, speculative.method)
            check_draft_length(head, draft, max_model_len)
            logger.info("EAGLE head: %s (%.1f MiB)", head, draft.weight_bytes / 2**20)
        elif speculative is not None and speculative.method == "medusa":
            k = speculative.num_speculative_tokens
            draft = load_medusa_heads(speculative.model or "", loaded, k, mesh)
        batched = self.max_num_batched_tokens or max(2048, self.max_num_seqs)
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            scheduling_policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
            preemption_mode=self.preemption_mode,
            max_loras=lora.max_loras if lora is not None else 0,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=resolve_prefix_caching(self.enable_prefix_caching, loaded.spec),
            swap_space=self.swap_space,
            kv_offloading_size=host_tier_gib(self),
            kv_cache_dtype=self.kv_cache_dtype,
        )
        lookahead = speculative.num_speculative_tokens if speculative is not None else 0
        num_blocks = self._num_blocks(loaded, cache, scheduler, mesh, draft, lookahead)
        check_kv_capacity(scheduler, cache, num_blocks)  # before compiling anything
        num_host_blocks, num_tier_blocks = self._num_host_blocks(loaded, cache, scheduler, draft)
        if dist is not None and dist.num_processes > 1:
            if num_host_blocks or num_tier_blocks:
                raise ValueError(
                    "multi-host runs keep the KV cache on the devices: preemption_mode='swap' "
                    "and kv_offloading_size are single-host"
                )
            fingerprint = step_channel.start_fingerprint(vars(self), self.model)
            client = step_channel.coordination_client()
            num_blocks = step_channel.agree_on_start(
                client, dist.process_id, dist.num_processes, fingerprint, num_blocks
            )
            step_channel.start_liveness(dist.process_id, dist.num_processes)
        runner = runner_class(self)(
            loaded,
            num_blocks,
            cache,
            scheduler,
            mesh,
            num_host_blocks + num_tier_blocks,
            lookahead,
            draft,
            parallel.pipeline_micro_batches,
            None if cache_dir is None else cache_dir / EXECUTABLES_DIR,
            lora,
        )
        runner.warm_up()
        config = EngineConfig(model_config, cache, scheduler, parallel, speculative, lora)
        return _Built(runner, loaded, config, num_host_blocks, num_tier_blocks)

    def _check_pipeline(self, speculative: SpeculativeConfig | None) -> None:
        """What pipeline stages do not support yet, named before anything loads."""
        unsupported = {
            "a draft model or an EAGLE head (n-gram speculation works)": speculative is not None
            and speculative.method != "ngram",
            "cpu_offload_gb": self.cpu_offload_gb > 0,
        }
        named = [what for what, used in unsupported.items() if used]
        if named:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} does not support "
                f"{', '.join(named)} yet"
            )

    def _num_host_blocks(
        self,
        loaded: LoadedModel,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        draft: LoadedModel | None = None,
    ) -> tuple[int, int]:
        """Host blocks for swap preemption (swap_space GiB per device) and for the prefix
        cache's host tier (kv_offloading_size GiB), checked against the host memory
        available now."""
        swap = cache.swap_space if scheduler.preemption_mode == "swap" else 0.0
        tier = cache.kv_offloading_size if cache.enable_prefix_caching else 0.0
        if not swap and not tier:
            return 0, 0
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        needed = int((swap + tier) * memory.GIB) * tp * pp
        available = memory.available_host_bytes()
        if needed > available:
            raise ValueError(
                f"swap_space={swap} and kv_offloading_size={tier} GiB per device "
                f"({needed / memory.GIB:.1f} GiB for {tp * pp} device(s)) exceed the "
                f"{available / memory.GIB:.1f} GiB of host memory available; lower "
                "--swap-space or --kv-offloading-size"
            )
        # A host block holds every device's share, so swap_space GiB per device hold as
        # many blocks as one device's share fits.
        per_block = _block_bytes(loaded, cache, tp, pp, draft)
        # No more than every sequence at full length could ever swap out.
        useful = scheduler.max_num_seqs * -(-scheduler.max_model_len // cache.block_size)
        num_swap = min(memory.host_block_count(swap, per_block), useful)
        num_tier = memory.host_block_count(tier, per_block)
        logger.info(
            "Host KV memory: %d swap blocks, %d prefix-tier blocks of %d tokens",
            num_swap,
            num_tier,
            cache.block_size,
        )
        return num_swap, num_tier

    def _num_blocks(
        self,
        loaded: LoadedModel,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        mesh: Any,
        draft: LoadedModel | None = None,
        lookahead: int = 0,
    ) -> int:
        """KV blocks: `num_gpu_blocks_override`, else vLLM's sizing rule on a device
        that reports its memory (`kv_sizing`), else `cpu_kv_cache_bytes`."""
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        per_block = _block_bytes(loaded, cache, tp, pp, draft)
        sized = device_kv_blocks(loaded, cache, scheduler, mesh, per_block, pp, draft, lookahead)
        if sized is not None:
            return sized
        size = memory.kv_cache_size(
            self.cpu_kv_cache_bytes,
            per_block,
            cache.block_size,
            scheduler.max_num_seqs,
            scheduler.max_model_len,
        )
        logger.info(
            "GPU KV cache size: %d tokens (%d blocks of %d)",
            size.num_tokens,
            size.num_blocks - 1,
            cache.block_size,
        )
        return size.num_blocks


class _Built(NamedTuple):
    runner: ModelRunner
    loaded: LoadedModel
    config: EngineConfig
    num_host_blocks: int
    num_tier_blocks: int


def _block_bytes(
    loaded: LoadedModel, cache: CacheConfig, tp: int, pp: int, draft: LoadedModel | None
) -> int:
    """Bytes per device of one KV block: the target's layers and a draft model's, of a
    device's heads (`tp`) and of its pipeline stage's layers (`pp`)."""
    itemsize = np.dtype(cache.kv_dtype(loaded.dtype)).itemsize
    models = [loaded] + ([draft] if draft is not None else [])
    per_tp = sum(memory.kv_block_bytes(m.spec, cache.block_size, itemsize, tp) for m in models)
    if hybrid_sliding_window(loaded.spec, cache.enable_prefix_caching, draft is not None, pp):
        per_tp //= 2  # a full and a sliding layer share each array (`models/kv_groups.py`)
    return per_tp // pp

"""ModelRunner: owns the parameters, the paged KV cache and the jitted step.

With `block_copies` (whole-block copies and swaps) and `step_result` (a step's one
sync), the only place that moves data between host and device; what each program
computes on the device is `step_programs`'. Per step: one packed
int32 buffer and the sampling arrays in; sampled tokens and logprobs out. The
forward and the sampler are two jitted programs dispatched back to back with no
host sync between them (the logits never leave the device), so sampling options
that change the sampler's shapes (penalty history width) never recompile the
model. The KV cache is donated to every call and so updated in place.

`forward()` then `sample()` (the engine's `StepRunner` calls) return at once, the
second with a `PendingStep`; its `result()` is the one sync.
The sampled tokens of the latest step also stay on the device (`last_sampled`,
padded to the largest row bucket), where the next step's placeholder tokens read
them, so the host can prepare step N + 1 while step N runs.

Static shapes: T (tokens) is padded to a bucket of `input_batch.token_buckets` (steps
of 16 up to 128, then four sizes per doubling; on CPU devices 1, 4 and 8 below those, where
a forward's cost grows with its rows) up to `max_num_batched_tokens`; S (rows)
to `min(T, max_num_seqs)`, so one forward program exists per T bucket. With
speculative decoding (k draft tokens a row at most) the logits and sampler rows are
`min(T, max_num_seqs * (1 + k))`: every position a row verifies gets sampled. On CPU
devices every bucket's logits are padded to the largest bucket's rows (`max_rows`,
rounded up to whole `sampler.GROUP_ROWS_CPU` groups), and one sampler program with its
token bitmask serves every bucket (the bitmask applied inside the sampler's groups),
sampling only the groups that hold real rows.
Each program is a `programs.Program`; `num_compilations` counts the executables they
hold (compiled, or read from the `ExecutableStore` of an earlier start), one per shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.step_io import DraftRow, RowColumns, SchedulerOutput, StepSampling
from jvllm.layers import sampler
from jvllm.lora.config import LoRAConfig
from jvllm.models.kv_groups import hybrid_sliding_window, num_kv_arrays
from jvllm.models.loader import HOST_MEMORY, LoadedModel
from jvllm.parallel.mesh import pp_size, replicated
from jvllm.parallel.pipeline import schedule_utilization
from jvllm.parallel.step_channel import StepPublisher
from jvllm.runner.block_copies import BlockCopier
from jvllm.runner.draft_feed import PendingDrafts, feed_draft_tokens
from jvllm.runner.drafter import Drafter, ProposalInputs, make_drafter
from jvllm.runner.encoder_runner import EncoderRunner, step_inputs
from jvllm.runner.input_batch import (
    BatchShape,
    StepRow,
    micro_batch_tokens,
    pack_micro_batches,
    pack_rows,
    pick_bucket,
    pow2_buckets,
    row_lengths,
    token_buckets,
    total_spec_tokens,
    total_tokens,
)
from jvllm.runner.launches import Forward, Launches
from jvllm.runner.lora_weights import DeviceLoRA, LoRARunner
from jvllm.runner.memory import retain_freed_host_memory
from jvllm.runner.programs import Program
from jvllm.runner.start_up import StartUp
from jvllm.runner.step_programs import (
    SCORE_GROUP_TOKENS_CPU,
    StepPrograms,
    group_rows_on,
    params_platform,
)
from jvllm.runner.step_result import PendingStep, split_by_row

MIN_TOKEN_BUCKET = 16
# Below MIN_TOKEN_BUCKET on CPU devices, where a few decoding rows padded to 16 cost a
# third more forward time (matmuls compute every padded row); a GPU's cost is flat there.
# One row has its own: XLA:CPU's matrix-vector products read the weights once, where 4
# rows take 1.4x as long (a lone request decodes 15% faster). Two rows gain nothing
# against 4, so they share its program.
SMALL_TOKEN_BUCKETS_CPU = (1, 4, 8)


class ModelRunner(StartUp, Launches, LoRARunner):
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        mesh: Mesh | None = None,
        num_host_blocks: int = 0,
        num_lookahead_tokens: int = 0,
        draft: LoadedModel | None = None,
        num_micro_batches: int | None = None,
        executable_dir: Path | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """`num_blocks` KV blocks of `cache_config.block_size` tokens, and
        `num_host_blocks` more in host memory for swapped-out requests; the scheduler's
        limits fix the buckets and the block-table width, and `num_lookahead_tokens`
        (speculative decoding's k) the logits rows a row may need beyond its one.
        `draft`: speculative decoding's draft model or EAGLE head, whose KV layers
        follow the target's in `caches` (same blocks). On a mesh with pipeline stages,
        each step runs as `num_micro_batches` micro-batches (default: one per stage).
        `executable_dir`: where compiled programs are stored for the next start
        (`ExecutableStore`; None: compile every start). `lora_config`: LoRA slots."""
        self.pp = pp_size(mesh)
        if self.pp > 1 and draft is not None:
            raise ValueError(
                f"pipeline_parallel_size={self.pp} supports n-gram speculation only, not "
                "a draft model or an EAGLE head yet"
            )
        self.num_micro = (num_micro_batches or self.pp) if self.pp > 1 else 1
        if self.num_micro < 1:
            raise ValueError(f"pipeline micro-batches must be >= 1, got {self.num_micro}")
        # Pipelined steps: (busy, capacity) stage-token units of the schedules run so far
        # (`pipeline.schedule_utilization`).
        self.pipeline_load = [0.0, 0.0]
        # Every forward so far: [real tokens, token slots computed]; the rest of the
        # slots are bucket padding.
        self.token_slots = [0, 0]
        # Multi-host serving's leader: where each launch is published for the followers.
        self.publisher: StepPublisher | None = None
        # The last forward's logits, hidden states, last input tokens and shape.
        self._last_forward: Forward | None = None
        self._forward_rows: Sequence[StepRow] | None = None  # the forward `sample` follows
        self.model = loaded
        k, block_size = num_lookahead_tokens, cache_config.block_size
        self.drafter: Drafter | None = make_drafter(draft, loaded, k, block_size)
        # The hybrid KV layout's sliding window (`models/kv_groups.py`), read by the engine.
        self.kv_sliding_window = hybrid_sliding_window(
            loaded.spec, cache_config.enable_prefix_caching, draft is not None, self.pp
        )
        self.num_target_layers = num_kv_arrays(loaded.spec, self.kv_sliding_window is not None)
        self.mesh = mesh
        self.lora = DeviceLoRA(lora_config, loaded, mesh) if lora_config is not None else None
        self.encoder = EncoderRunner(*loaded.vision) if loaded.vision is not None else None
        self.spec = loaded.spec
        self.block_size = block_size
        self.kv_dtype = jnp.dtype(cache_config.kv_dtype(loaded.dtype))
        self.num_blocks = num_blocks
        self.max_num_seqs = scheduler_config.max_num_seqs
        max_model_len = scheduler_config.max_model_len
        # Both groups' tables side by side in the hybrid layout.
        self.width = math.ceil(max_model_len / block_size) * (2 if self.kv_sliding_window else 1)
        buckets = token_buckets(scheduler_config.max_num_batched_tokens, MIN_TOKEN_BUCKET)
        small = SMALL_TOKEN_BUCKETS_CPU if params_platform(loaded.params) == "cpu" else ()
        self.token_buckets = (*(b for b in small if b < buckets[0]), *buckets)
        self.num_lookahead_tokens = num_lookahead_tokens
        # The largest logits-row bucket; where the sampler takes its rows in groups
        # (CPU devices), rounded up to whole groups: every step's sampling rows.
        self.max_rows = self.batch_shape(self.token_buckets[-1]).logits_rows
        self.group_rows = group_rows_on(params_platform(loaded.params))
        self.max_tokens = 0  # the hidden states' rows where they are padded (CPU devices)
        if self.group_rows is not None:
            self.max_rows = -(-self.max_rows // self.group_rows) * self.group_rows
            most = self.batch_shape(self.token_buckets[-1]).num_tokens
            self.max_tokens = -(-most // SCORE_GROUP_TOKENS_CPU) * SCORE_GROUP_TOKENS_CPU
        # Offloaded weights (cpu_offload_gb): parameter path -> its device-memory sharding.
        bring_in_shardings = {
            jax.tree_util.keystr(path): leaf.sharding.with_memory_kind("device")
            for path, leaf in jax.tree_util.tree_leaves_with_path(loaded.params)
            if getattr(leaf, "sharding", None) is not None
            and leaf.sharding.memory_kind == HOST_MEMORY
        }
        q_shape = (self.max_num_seqs * num_lookahead_tokens, loaded.spec.vocab_size)
        self.step_programs = StepPrograms(
            model=loaded,
            drafter=self.drafter,
            mesh=mesh,
            max_rows=self.max_rows,
            max_tokens=self.max_tokens,
            draft_probs_shape=q_shape if self.drafter is not None else None,
            bring_in_shardings=bring_in_shardings,
        )
        if self.step_programs.platform == "cpu":
            retain_freed_host_memory()  # XLA:CPU's temporaries, reused step after step
        self.caches = self._allocate_cache(num_blocks)
        store = self.executable_store = self._executable_store(executable_dir)
        # On CPU devices a model forward loaded from the store ran mix48 at 0.67x of the
        # same forward compiled in the process or served by JAX's persistent cache (its
        # matmuls took a slower YNNPACK path, with a transpose): there the forwards are
        # kept by JAX's cache only, which costs a warm start their tracing and lowering.
        model_store = None if self.step_programs.platform == "cpu" else store
        self.draft_probs = None  # [Q, V] device array: the last proposal's q rows
        self.proposed = None  # [S, k] device array: the last proposal's drafts
        # [R, H] device array: an EAGLE head's input, the last step's logits rows' hidden
        # states (padded to the largest logits-row bucket, so one proposal program each).
        self.features = None
        if self.drafter is not None:
            # Row counts of the proposal programs: 4, 16, ... max_num_seqs (a 1-row program
            # ran an EAGLE proposal in ~105 ms against ~8 ms padded to 4, max_num_seqs 32).
            self.proposal_buckets = pow2_buckets(min(4, self.max_num_seqs), self.max_num_seqs, 4)
            q = np.zeros(q_shape, np.float32)  # on the device, as what replaces it
            self.draft_probs = self._device_array(q)
            self._propose_fn = Program(
                self.step_programs.propose,
                "propose",
                model_store,
                donate_argnames=("caches",),
                fixed=(0, 1, 2),
            )
        zeros = np.zeros(self.max_rows, np.int32)  # [R]
        # A device array, like the sampler output that replaces it every step: a host
        # array here would give every forward bucket a second program at serve time.
        self.last_sampled = self._device_array(zeros)
        # [max_rows, V] float32 where the sampler takes its rows in groups: each forward
        # writes its logits rows over the last step's (donated), the rest unread.
        self.logits_buffer = None
        self.bitmask_words = words = -(-self.spec.vocab_size // 32)  # a token bitmask's width
        # [max_rows, words]: the bitmask of a step with no masked row (grouped sampling).
        self.allow_all = None
        if self.group_rows is not None:
            logits = np.zeros((self.max_rows, self.spec.vocab_size), np.float32)
            self.logits_buffer = self._device_array(logits)
            self.allow_all = self._device_array(np.full((self.max_rows, words), -1, np.int32))
        programs = self.step_programs
        self._forward_fn = Program(
            programs.forward,
            "forward",
            model_store,
            static_argnames=("shape",),
            donate_argnames=("caches", "logits_buffer"),
            fixed=(0, 1),
            fixed_kwargs=("lora_weights",),
        )
        self._sample_fn = Program(programs.sample, "sample", store)
        self._mask_fn = Program(programs.apply_bitmask, "mask", store)
        self._all_logprobs_fn = Program(programs.all_logprobs, "all_logprobs", store, fixed=(0,))
        # Host block 0 is never used: the pool has one block more than it hands out.
        host_shapes = self._layer_shapes(num_host_blocks + 1) if num_host_blocks else []
        self.blocks = BlockCopier(self.pp, store, self._put, host_shapes, np.dtype(self.kv_dtype))

    @property
    def num_compilations(self) -> int:
        """Programs compiled so far: the entries of every jitted function's cache."""
        jitted = (
            *((self._propose_fn,) if self.drafter is not None else ()),
            self._forward_fn,
            self._sample_fn,
            self._mask_fn,
            self._all_logprobs_fn,
            *self.blocks.programs,
            *((self.lora.write_program,) if self.lora is not None else ()),
        )
        return sum(len(fn.executables) for fn in jitted)

    # -- host side --

    @property
    def host_caches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The host-memory pool of swapped-out blocks, per KV layer (empty: no swap)."""
        return self.blocks.host_caches

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device, host) block copies, queued before anything this step writes."""
        self.blocks.swap_out(self.caches, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host, device) block copies, queued before the step's forward."""
        self.caches = self.blocks.swap_in(self.caches, pairs)

    def _put(self, tree: Any) -> Any:
        """Host arrays for a jitted program; on a mesh, placed replicated on every device.

        On one device they stay numpy: the jitted call transfers its numpy arguments
        itself, in C++ (about 25 us for the sampling arrays), where `device_put` of the
        same pytree from Python takes about 0.9 ms.
        """
        if self.mesh is None:
            return tree
        sharding = replicated(self.mesh)
        if jax.process_count() == 1:
            return jax.device_put(tree, sharding)
        # Multi-host: every process built the same host arrays; each places its copy.
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)

    def batch_shape(self, num_tokens: int, micro_tokens: int | None = None) -> BatchShape:
        """The bucketed shape of a step of `num_tokens`; with pipeline stages, of
        micro-batches of at most `micro_tokens` (default `num_tokens`) each."""
        if self.pp > 1:
            m = self.num_micro
            most = num_tokens if micro_tokens is None else micro_tokens
            tm = pick_bucket(most, self.token_buckets)
            sm = min(tm, self.max_num_seqs)
            rows = min(m * sm, self.max_num_seqs)
            k = self.num_lookahead_tokens
            logits = min(m * tm, self.max_num_seqs * (1 + k)) if k else 0
            return BatchShape(m * tm, rows, self.width, logits, m, sm)
        t = pick_bucket(num_tokens, self.token_buckets)
        rows = min(t, self.max_num_seqs)
        logits = min(t, self.max_num_seqs * (1 + self.num_lookahead_tokens))
        k = self.num_lookahead_tokens
        return BatchShape(t, rows, self.width, logits if k else 0, lora=self.lora is not None)

    def sampling_rows(self, shape: BatchShape) -> int:
        """The sampler's rows for a step of `shape`: its logits rows, or `max_rows` where
        the sampler takes its rows in groups (one program for every bucket)."""
        return shape.logits_rows if self.group_rows is None else self.max_rows

    def scored_positions(self, shape: BatchShape) -> int:
        """The prompt-logprob program's positions for a step of `shape`: its tokens, or
        `max_tokens` where positions are scored in groups (one program for every bucket;
        targets -1 past the step's tokens)."""
        return self.max_tokens or shape.num_tokens

    def _run_forward(
        self,
        rows: Sequence[StepRow],
        shape: BatchShape | None = None,
        block_tables: np.ndarray | None = None,
        lora_slots: np.ndarray | None = None,
        mm_features: dict | None = None,
        draft_feed: bool = False,
        columns: RowColumns | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, BatchShape]:
        num_tokens = total_tokens(rows)
        if self.pp > 1:
            shape = shape or self.batch_shape(0, micro_batch_tokens(rows, self.num_micro))
            packed, sizes = pack_micro_batches(rows, shape, self.block_size, block_tables)
            busy, capacity = schedule_utilization(sizes, self.pp)
            self.pipeline_load[0] += busy
            self.pipeline_load[1] += capacity
        else:
            shape = shape or self.batch_shape(num_tokens)
            packed = pack_rows(rows, shape, self.block_size, block_tables, lora_slots, columns)
            if draft_feed:  # draft tokens read on the device from the last proposal
                feed_draft_tokens(packed, shape, rows)
        self.token_slots[0] += num_tokens
        self.token_slots[1] += shape.num_tokens
        mm = step_inputs(self.encoder, rows, mm_features, shape.num_tokens)  # image embeddings
        self._launch_forward(packed, shape, mm)
        assert self._last_forward is not None
        return self._last_forward

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: whole-block copies, applied before the step that needs them."""
        for lo in range(0, len(pairs), self.max_num_seqs):
            chunk = list(pairs[lo : lo + self.max_num_seqs])
            chunk += [(0, 0)] * (self.max_num_seqs - len(chunk))  # null-block no-ops
            self._launch_copy(np.array(chunk, np.int32).T)

    def forward(self, scheduled: SchedulerOutput) -> None:
        """Queues the model over the step's rows and returns without waiting (its logits
        stay on the device for `sample`); tables from `block_tables` at each `table_row`."""
        rows, tables, sources = scheduled.scheduled, scheduled.block_tables, scheduled.draft_sources
        if sources is not None:
            self._launch_place_drafts(sources)
        mm, feed = scheduled.mm_features, sources is not None
        self._run_forward(rows, None, tables, scheduled.lora_slots, mm, feed, scheduled.columns)
        self._forward_rows = rows

    def sample(self, sampling: StepSampling) -> PendingStep:
        """Queues the sampler over the logits of the forward queued last and returns
        without waiting: `result()` on what it returns is the step's one sync. A row
        verifying k draft tokens takes 1 + k consecutive sampling rows (and bitmask
        rows), one per position it scores."""
        assert self._last_forward is not None and self._forward_rows is not None
        rows, shape = self._forward_rows, self._last_forward[3]
        self._forward_rows = None  # one sample per forward
        assert len(sampling.rows) == len(rows) + total_spec_tokens(rows)
        num_rows = self.sampling_rows(shape)
        md = sampler.make_sampling_metadata(sampling.rows, num_rows)
        padded = None
        if sampling.token_bitmask is not None:
            bitmask = sampling.token_bitmask  # [len(sampling.rows), W] int32
            padded = np.full((num_rows, bitmask.shape[1]), -1, np.int32)
            padded[: len(bitmask)] = bitmask
        targets = None
        if sampling.prompt_targets is not None:
            targets = np.full(self.scored_positions(shape), -1, np.int32)  # [T'] int32
            flat = [t for row in sampling.prompt_targets for t in row]
            targets[: len(flat)] = flat
        out, scored = self._launch_sample(md, padded, targets)
        return PendingStep(out, scored, row_lengths(rows), len(sampling.rows))

    def propose(self, rows: Sequence[DraftRow], num_rows: int | None = None) -> PendingDrafts:
        """The proposer's k tokens for each row, not waited for (`PendingDrafts`; a
        step's `draft_sources` feeds them to its forward on the device); their
        distributions stay on the device (`draft_probs`, row r's i-th token at r * k +
        i) for the next step's rejection sampler. `num_rows` forces the row bucket
        (warm-up). An EAGLE head reads the hidden states of the step last run (`features`)."""
        assert self.drafter is not None
        n = len(rows)
        s = num_rows or pick_bucket(max(n, 1), self.proposal_buckets)
        inputs = ProposalInputs(
            tokens=np.zeros(s, np.int32),
            positions=np.zeros(s, np.int32),
            tables=np.zeros((s, self.width), np.int32),
            limits=np.zeros(s, np.int32),
            seeds=np.zeros(s, np.uint32),
            steps=np.zeros(s, np.int32),
            temperature=np.zeros(s, np.float32),
            feature_rows=np.zeros(s, np.int32),
        )
        for i, row in enumerate(rows):
            inputs.tokens[i], inputs.positions[i] = row.token_id, row.position
            inputs.tables[i, : len(row.block_table)] = row.block_table
            inputs.limits[i], inputs.seeds[i] = row.num_tokens, row.seed
            inputs.steps[i], inputs.temperature[i] = row.step_index, row.temperature
            inputs.feature_rows[i] = row.feature_row
        return PendingDrafts(self._launch_propose(inputs), [row.num_tokens for row in rows])

    def forward_logits(
        self, rows: Sequence[StepRow], every_token: bool = False
    ) -> list[np.ndarray]:
        """Runs one step; each row's logits: `[V]` of its last token, or `[n, V]` of
        all its n new tokens when `every_token` (tests and scoring)."""
        logits, hidden, _, _ = self._run_forward(rows)
        if not every_token:
            # A host copy: the next forward reuses the device buffer (donated).
            return list(np.asarray(logits)[: len(rows)].copy())
        module = self.model.module
        every = np.asarray(
            module.apply({"params": self.model.params}, hidden, method=module.logits)
        )
        return split_by_row(every, [len(r.token_ids) for r in rows])

"""What a runner does once, at start: its KV cache, its executable store, warm-up.

Owns allocating the paged KV cache (per layer, sharded on a mesh), opening the store
of compiled programs kept for the next start, and `warm_up`, which compiles and runs
every program serving can need. `ModelRunner` mixes this in; the step itself is its
own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from jvllm.engine.step_io import SamplingRow
from jvllm.kernels import cpu_attention
from jvllm.layers import sampler
from jvllm.layers.attention import KVCache
from jvllm.models.loader import LoadedModel
from jvllm.parallel.mesh import cache_sharding
from jvllm.runner.block_copies import SWAP_BUCKETS
from jvllm.runner.drafter import Drafter
from jvllm.runner.input_batch import BatchShape
from jvllm.runner.launches import Forward
from jvllm.runner.programs import ExecutableStore, Program, scope_digest
from jvllm.sampling_params import SamplingParams


class StartUp:
    """The start-up half of `ModelRunner` (whose `__init__` sets these attributes)."""

    model: LoadedModel
    spec: Any  # ModelSpec
    mesh: Mesh | None
    pp: int
    block_size: int
    kv_dtype: Any  # jnp.dtype
    num_target_layers: int
    drafter: Drafter | None
    group_rows: int | None
    logits_buffer: jax.Array | None
    max_rows: int
    token_buckets: tuple[int, ...]
    proposal_buckets: tuple[int, ...]
    bitmask_words: int
    allow_all: jax.Array | None
    draft_probs: jax.Array | None
    host_caches: list[tuple[np.ndarray, np.ndarray]]
    caches: list[KVCache]
    _sample_fn: Program
    _mask_fn: Program
    _all_logprobs_fn: Program
    _put: Callable[[Any], Any]
    _run_forward: Callable[..., Forward]
    batch_shape: Callable[[int], BatchShape]
    sampling_rows: Callable[[BatchShape], int]
    scored_positions: Callable[[BatchShape], int]
    copy_blocks: Callable[[Sequence[tuple[int, int]]], None]
    propose: Callable[..., list[list[int]]]
    swap_out: Callable[[Sequence[tuple[int, int]]], None]
    swap_in: Callable[[Sequence[tuple[int, int]]], None]

    def _executable_store(self, directory: Path | None) -> ExecutableStore | None:
        """The store of this runner's programs: one scope per model, engine configuration
        and set of devices. Multi-process meshes compile every start."""
        if directory is None or jax.process_count() > 1:
            return None
        if self.model.module.backend == "cpu":
            # A stored program calls the C++ kernel by its FFI name, which a trace would
            # otherwise have registered.
            cpu_attention.register()
        drafter = None if self.drafter is None else self.drafter.model.module
        configuration = (
            self.model.module,
            drafter,
            self.kv_dtype,
            self.num_blocks,
            self.width,
            self.token_buckets,
            self.max_num_seqs,
            self.num_lookahead_tokens,
            self.num_micro,
            self.mesh,
            sorted(self.step_programs.bring_in_shardings.items()),
        )
        return ExecutableStore(directory, scope_digest(configuration))

    def _layer_shapes(self, num_blocks: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each KV layer's K and V shapes (`ModelSpec.kv_cache_dims`): the target's layers,
        then the draft's. With pipeline stages, a stage's j-th layer and every other
        stage's are one array."""
        if self.pp > 1:
            heads, k_dim, v_dim = self.spec.kv_cache_dims
            shape = (self.pp, num_blocks, self.block_size, heads)
            return [((*shape, k_dim), (*shape, v_dim))] * (self.spec.num_layers // self.pp)
        # The target's arrays are one per full/sliding layer pair in the hybrid layout.
        specs = [(self.spec, self.num_target_layers)]
        if self.drafter is not None:
            specs.append((self.drafter.model.spec, self.drafter.model.spec.num_layers))
        shapes = []
        for s, num_arrays in specs:
            heads, k_dim, v_dim = s.kv_cache_dims
            shape = (num_blocks, self.block_size, heads)
            shapes += [((*shape, k_dim), (*shape, v_dim))] * num_arrays
        return shapes

    def _device_array(self, x: np.ndarray) -> jax.Array:
        """`x` on the device as a program's output of it would be placed. With offloaded
        weights, program outputs name their memory kind: so must this, or the program
        that takes it compiles once for each."""
        if self.mesh is not None:
            return self._put(x)
        return jax.device_put(x, self._device_memory())

    def _device_memory(self) -> SingleDeviceSharding | None:
        """Device memory, named when weights are offloaded (see `_device_array`)."""
        if not self.step_programs.bring_in_shardings:
            return None
        return SingleDeviceSharding(jax.local_devices()[0], memory_kind="device")

    def _allocate_cache(self, num_blocks: int) -> list[KVCache]:
        # KV heads split across the mesh; on one device, see _device_array.
        sharding = cache_sharding(self.mesh, self.spec.kv_cache_split) or self._device_memory()
        # Zeroed, not empty: masked slots must never hold NaN (0 * NaN = NaN).
        zeros = lambda shape: jnp.zeros(shape, self.kv_dtype, device=sharding)
        return [(zeros(k), zeros(v)) for k, v in self._layer_shapes(num_blocks)]

    def _warm_up_sampling(self, forward: Forward) -> None:
        """Compiles and runs the sampler, bitmask and prompt-logprob programs of one
        forward's shape."""
        logits, hidden, last_input, shape = forward
        self._warm_up_sampler(logits, last_input, self.sampling_rows(shape))
        self._warm_up_prompt_logprobs(hidden, shape)

    def _warm_up_sampler(self, logits: jax.Array, last_input: jax.Array, num_rows: int) -> None:
        greedy = SamplingRow(SamplingParams(temperature=0.0), 0, 0, (), ())
        md = self._put(sampler.make_sampling_metadata([greedy], num_rows))
        if self.group_rows is not None:  # one program, the bitmask inside
            out = self._sample_fn(logits, md, last_input, self.draft_probs, self.allow_all)
            jax.block_until_ready(out)
            return
        jax.block_until_ready(self._sample_fn(logits, md, last_input, self.draft_probs))
        mask = self._put(np.full((num_rows, self.bitmask_words), -1, np.int32))
        jax.block_until_ready(self._mask_fn(logits, mask))

    def _warm_up_prompt_logprobs(self, hidden: jax.Array, shape: BatchShape) -> None:
        targets = np.full(self.scored_positions(shape), -1, np.int32)
        targets[0] = 0  # one position scored
        targets = self._put(targets)
        jax.block_until_ready(self._all_logprobs_fn(self.model.params, hidden, targets))

    def warm_up(self) -> None:
        """Compiles every program serving can need (penalised sampling, and more than
        MIN_BIAS_ENTRIES biased or banned tokens in one step, aside), and runs each once.

        On one CPU device the sampler and prompt-logprob programs (one each for every
        bucket, the bitmask in the sampler) load and run in a second thread while the
        forwards do: XLA runs them without the GIL, so a start keeps two cores busy.
        Elsewhere the buckets go one at a time: a GPU keeps room for one step's
        activations only (`memory.activation_reserve`), and on a mesh every device must
        run the programs in one order (their collectives would wait on each other)."""
        shapes = [self.batch_shape(t) for t in self.token_buckets]
        # No real rows: every token is padding and writes into the null block.
        if self.model.module.backend != "cpu" or self.mesh is not None:
            for shape in shapes:
                self._warm_up_sampling(self._run_forward([], shape))
        else:
            assert self.logits_buffer is not None  # one CPU device: grouped sampling
            # Arrays of their own: each forward donates the logits buffer.
            logits = self._device_array(np.zeros(self.logits_buffer.shape, np.float32))
            last_input = self._device_array(np.zeros(self.max_rows, np.int32))
            with ThreadPoolExecutor(1, thread_name_prefix="jvllm-warm-up") as pool:
                pending = [pool.submit(self._warm_up_sampler, logits, last_input, self.max_rows)]
                for i, shape in enumerate(shapes):
                    _, hidden, _, _ = self._run_forward([], shape)
                    if i == 0:  # every bucket's hidden states have the one padded shape
                        pending.append(pool.submit(self._warm_up_prompt_logprobs, hidden, shape))
                for done in pending:
                    done.result()
        self.copy_blocks([(0, 0)])
        if self.drafter is not None:
            for size in self.proposal_buckets:
                self.propose([], size)
                if isinstance(self.last_sampled, jax.Array):  # not when compiling ahead
                    self._launch_place_drafts(np.zeros(0, np.int32))  # its size's program
        if self.host_caches:
            for size in SWAP_BUCKETS:
                self.swap_out([(0, 0)] * size)
                self.swap_in([(0, 0)] * size)
        # The forwards were only queued (on one CPU device nothing waited on them): ready
        # means they ran, or the first request would wait for the rest of the warm-up.
        if all(isinstance(c, jax.Array) for c in jax.tree.leaves(self.caches)):  # not AOT
            jax.block_until_ready(self.caches)

"""Pipeline parallelism: the decoder's layers in `pp` stages along the mesh's `pp` axis.

Design. The mesh is `pp x tp` (`mesh.make_mesh`). Stage s holds layers
s * L/pp .. (s + 1) * L/pp - 1: each parameter of a stage's j-th layer is one array
`[pp, ...]` split on `pp` (stage s's devices hold only their layer's slice, further
split on `tp` as without stages), and so is each KV layer `[pp, N, BS, Hkv, D]`. The
embedding and lm_head are vocab-parallel over all `pp * tp` devices, so they run on every
stage at once rather than on the first and the last.

One step is ONE jitted program. The step's tokens, in row order, are cut into M
micro-batches of equal size (`input_batch.cut_rows`; a row across a cut becomes two
pieces, the later one attending to the KV the earlier one wrote a tick before at
every stage), each padded to the same bucket. Inside a
`shard_map` that makes `pp` manual (`tp` stays automatic, so tensor parallelism inside
a stage is unchanged), a loop of M + pp - 1 ticks runs the GPipe schedule: at tick i,
stage s runs its layers on micro-batch i - s, and `ppermute` hands every stage's output
to the next stage. A stage with no micro-batch at a tick (the fill and drain of the
pipeline, or an empty micro-batch) skips its layers under `lax.cond`. The last stage's
outputs reach every device in one `psum` over `pp`; the final norm and lm_head follow
outside the loop. With M = pp micro-batches each stage is busy M / (M + pp - 1) of the
ticks (4 / 7 at pp = 4), against 1 / pp (1 / 4) with one batch in flight.

Micro-batches of one step write disjoint KV slots, and a stage runs them in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jvllm.parallel.mesh import PP_AXIS, cache_sharding, pp_size

# stage_fn(layer_params, caches, x [Tm, H], micro-batch inputs) -> (x, caches): one
# stage's layers, on that stage's devices (leading `pp` axes already dropped).
StageFn = Callable[[Any, Any, jax.Array, Any], tuple[jax.Array, Any]]


def run_pipeline(
    stage_fn: StageFn,
    mesh: Mesh,
    layer_params: Any,
    caches: Any,
    x: jax.Array,
    inputs: Any,
    busy: jax.Array,
) -> tuple[jax.Array, Any]:
    """Every micro-batch through every stage. `layer_params` and `caches`: pytrees of
    `[pp, ...]` arrays split on `pp`; `x` `[M, Tm, H]` the micro-batches' embeddings;
    `inputs` a pytree of `[M, ...]` arrays handed to `stage_fn` one micro-batch at a
    time; `busy` `[M]` bool, False for an empty micro-batch. Returns the last stage's
    outputs `[M, Tm, H]` on every device and the updated caches."""
    pp = pp_size(mesh)
    num_micro = x.shape[0]
    forward = [(s, s + 1) for s in range(pp - 1)]

    def body(layer_params: Any, caches: Any, x: jax.Array, inputs: Any, busy: jax.Array):
        stage = jax.lax.axis_index(PP_AXIS)
        layer_params = jax.tree.map(lambda a: a[0], layer_params)
        caches = jax.tree.map(lambda a: a[0], caches)

        def tick(i: jax.Array, carry: tuple[jax.Array, jax.Array, Any]):
            received, outputs, caches = carry
            micro = i - stage
            index = jnp.clip(micro, 0, num_micro - 1)
            works = (micro >= 0) & (micro < num_micro) & busy[index]
            h = jnp.where(stage == 0, x[index], received)
            mine = jax.tree.map(lambda a: a[index], inputs)
            h, caches = jax.lax.cond(
                works,
                lambda h, c: stage_fn(layer_params, c, h, mine),
                lambda h, c: (h, c),
                h,
                caches,
            )
            done = works & (stage == pp - 1)
            outputs = outputs.at[index].set(jnp.where(done, h, outputs[index]))
            return jax.lax.ppermute(h, PP_AXIS, forward), outputs, caches

        carry = (jnp.zeros_like(x[0]), jnp.zeros_like(x), caches)
        _, outputs, caches = jax.lax.fori_loop(0, num_micro + pp - 1, tick, carry)
        # Only the last stage holds the outputs; the others add zeros (exact).
        outputs = jax.lax.psum(jnp.where(stage == pp - 1, outputs, 0), PP_AXIS)
        return outputs, jax.tree.map(lambda a: a[None], caches)

    staged = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(PP_AXIS), P(PP_AXIS), P(), P(), P()),
        out_specs=(P(), P(PP_AXIS)),
        axis_names={PP_AXIS},
        check_vma=False,
    )
    outputs, caches = staged(layer_params, caches, x, inputs, busy)
    # The cache leaves as it came (heads on tp too): any other placement would make the
    # donated cache a copy, and the next call a second program.
    sharding = cache_sharding(mesh)
    return outputs, jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), caches)


def schedule_utilization(micro_tokens: Sequence[int], pp: int) -> tuple[float, float]:
    """(busy, capacity) stage-token units of one step's schedule: a tick lasts as long
    as its largest micro-batch; a stage is busy for its own micro-batch's tokens. Their
    ratio is the stages' utilisation if a tick's cost is proportional to its tokens."""
    m = len(micro_tokens)
    busy = float(pp * sum(micro_tokens))
    ticks = 0.0
    for i in range(m + pp - 1):
        ticks += max((micro_tokens[i - s] for s in range(pp) if 0 <= i - s < m), default=0)
    return busy, pp * ticks

"""The mixture-of-experts MLP as pure functions: routing, grouped expert matmuls, and
their split over a mesh.

Contract. `x [T, H]` are the tokens; each token goes to `top_k` of `E` experts, each a
SiLU-gated MLP whose weights are stacked `[E, out, in]` as the checkpoint stores them
(`w_gate`, `w_up` `[E, I, H]`, `w_down` `[E, H, I]`). The output is
`sum_k weight[t, k] * expert_{experts[t, k]}(x[t])`.

- Each expert is `down(act(gate(x) [+ b_gate], up(x) [+ b_up]))`: `act` SiLU-and-multiply,
  or gpt-oss's clamped SwiGLU (`"swigluoai"`, `layers/grouped_matmul.py`), with optional
  per-expert gate/up biases (`ExpertBiases`); a down bias is the caller's to add.
- `route`: softmax over the router logits in float32, top-k, the k weights renormalised
  to sum to 1 when asked. Exact ties go to the lower expert index (`jax.lax.top_k`);
  `torch.topk`, which Transformers uses, leaves the order of ties unspecified, and on
  CPU picks others (experts 2 and 4 of five equal logits): only identical router logits
  tie exactly, so this is the one place jvllm may route differently.
- `grouped_expert_mlp`: the token-expert pairs are sorted by expert and multiplied group
  by group; every shape is static (`[T * k, ...]`) whatever the routing, so no routing
  compiles a new program. With the "triton" backend (the GPU's) the groups run in
  `kernels/triton_grouped_matmul.py`, which reads only the routed experts' weights.
  Otherwise, in a program lowered for a CPU, they run in `layers/grouped_matmul.py`'s
  tile loop, which reads and multiplies only the non-empty experts; lowered for another
  platform, in `jax.lax.ragged_dot_general` (`cpu_method` forces either). XLA:GPU
  (jaxlib 0.10.2) expands ragged_dot into dense dots over every expert (docs/moe.md),
  and on a CPU JAX itself expands it into a masked dense product over every expert
  (`lax._ragged_dot_general_impl`). Measured on a shared 2-core CPU, float32, median
  of 10 alternated calls of the whole layer, router included (`bench/moe.py --layer`,
  two runs; bench/results/moe_cpu_grouped.json), ragged_dot / loop in ms:
  8 experts top-2, H 256, I 512 at 16/64/256/1024 tokens: 13.3/3.8, 22.5/3.5,
  57.6/14.2, 267.5/41.5; 64 experts top-4, H 512, I 256: 241/30.2, 366/37.3,
  1279/69.0, 5112/197. The loop wins at every size, the 16-token decode included
  (ragged_dot multiplies every expert for every row; the loop runs only the non-empty
  tiles), so no small-batch dense path is kept on a CPU.
- Quantized experts (`layers/expert_weights.py`): any of the three projections may be a
  `QuantizedExperts`, int8 or float8 values with per-(expert, output channel) scales that
  multiply the output rows: each tile's own expert's in the loop, each sorted row's
  expert's under `ragged_dot`.
- `dense_expert_mlp_reference`: a one-hot product over every expert, for tests only.
- `sharded_expert_mlp`: the same over a `tp` mesh, experts split on their intermediate
  axis (tensor parallel) or on the expert axis (expert parallel); see its docstring for
  why the expert-parallel form reduces rather than exchanging tokens all-to-all.

Not owned here: the Flax parameters and the shared expert (`models/llama.py`), reading
expert tensors (`models/expert_tensors.py`), which axes are split (`parallel/mesh.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jvllm.layers.expert_weights import (
    ExpertWeight,
    QuantizedExperts,
    dequantized,
    quantize_input_rows,
    scale_rows,
    stored_weight,
)
from jvllm.layers.grouped_matmul import ACTIVATIONS, ExpertBiases, tiled_expert_mlp
from jvllm.parallel.mesh import AXIS

# lhs [M, K] ragged on M; rhs [G, N, K] (the checkpoint's [out, in]) grouped on G.
_GROUPED_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


class Routing(NamedTuple):
    weights: jax.Array  # [T, k] float32
    experts: jax.Array  # [T, k] int32, each in [0, E)


def route(router_logits: jax.Array, top_k: int, renormalize: bool) -> Routing:
    """`router_logits [T, E]` -> each token's top-k experts and their weights."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k]
    if renormalize:
        # One division, as Transformers' `router_top_value /= sum`. Not bit-equal in float32
        # either way: from the same top-k values XLA:CPU matches torch's quotient on 44% of
        # weights (within 2e-7), and a second division changes that to 44.2%.
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, experts.astype(jnp.int32))


# Off the Triton backend, the experts' grouped matmul: the tile loop ("loop",
# `layers/grouped_matmul.py`), `ragged_dot`, or "auto": the loop when the program is
# lowered for a CPU, ragged_dot for any other platform (the deviceless GPU checks measure
# XLA's own expansion of it). On a CPU the loop was faster at every measured size,
# 16-token decodes included (module docstring). Its tile is the mean rows per expert
# rounded up to a power of two, within these bounds: of tiles 8/16/32/64 it was the
# fastest at 6 of the 8 measured sizes and within 22% at the other two.
CPU_METHODS = ("auto", "loop", "ragged_dot")
DEFAULT_CPU_METHOD = "auto"
CPU_TILE_BOUNDS = (8, 64)


def _grouped(
    rows: jax.Array,
    w: ExpertWeight,
    sorted_experts: jax.Array,
    group_sizes: jax.Array,
    backend: str,
) -> jax.Array:
    """rows [M, K] (sorted by group) times w [G, N, K] of each row's group -> [M, N];
    with the "triton" backend, a kernel that reads only the groups' own weights. A
    quantized w's stored values are cast to the rows' dtype (the kernel then reads a
    float copy: no int8 or float8 Triton kernel yet) and each output row is scaled by
    its expert's output-channel scales."""
    stored = stored_weight(w, rows.dtype)  # [G, N, K]
    rows = quantize_input_rows(rows, w)  # float8 per-token inputs, where w takes them
    if backend == "triton":
        from jvllm.kernels.jax_triton_grouped_matmul import grouped_matmul

        y = grouped_matmul(rows, stored, sorted_experts, group_sizes)
    else:
        y = jax.lax.ragged_dot_general(rows, stored, group_sizes, _GROUPED_OUT_IN)
    return scale_rows(y, w, sorted_experts)


def cpu_tile_for(num_pairs: int, num_experts: int) -> int:
    """Rows per tile of the CPU loop: about one tile per expert's mean group (static)."""
    low, high = CPU_TILE_BOUNDS
    mean = -(-num_pairs // num_experts)
    return min(high, max(low, 1 << (mean - 1).bit_length()))


def _sorted_expert_mlp(
    rows: jax.Array,  # [T*k, H], sorted by expert
    weights: tuple[ExpertWeight, ExpertWeight, ExpertWeight],  # gate, up [El, I, H]; down
    sorted_experts: jax.Array,  # [T*k] int32
    group_sizes: jax.Array,  # [El] int32
    backend: str,
    cpu_method: str,
    biases: ExpertBiases | None = None,
    activation: str = "silu",
) -> jax.Array:  # [T*k, H]; rows past the groups unspecified
    def ragged() -> jax.Array:
        return _ragged_expert_mlp(
            rows, weights, sorted_experts, group_sizes, backend, biases, activation
        )

    if backend == "triton" or cpu_method == "ragged_dot":
        return ragged()
    tile = cpu_tile_for(rows.shape[0], group_sizes.shape[0])

    def loop() -> jax.Array:
        return tiled_expert_mlp(rows, *weights, group_sizes, tile, biases, activation)

    # "auto": chosen when lowering, for the platform the program is lowered for.
    return loop() if cpu_method == "loop" else jax.lax.platform_dependent(cpu=loop, default=ragged)


def _ragged_expert_mlp(
    rows: jax.Array,  # [T*k, H], sorted by expert
    weights: tuple[ExpertWeight, ExpertWeight, ExpertWeight],
    sorted_experts: jax.Array,  # [T*k] int32
    group_sizes: jax.Array,  # [El] int32
    backend: str,
    biases: ExpertBiases | None = None,
    activation: str = "silu",
) -> jax.Array:  # [T*k, H]
    grouped = lambda a, w: _grouped(a, w, sorted_experts, group_sizes, backend)  # noqa: E731
    w_gate, w_up, w_down = weights
    gate, up = grouped(rows, w_gate), grouped(rows, w_up)  # [T*k, I]
    if biases is not None:
        # Rows past the local groups (expert El) take the last expert's bias; unused.
        gate = gate + jnp.take(biases.gate, sorted_experts, axis=0, mode="clip")
        up = up + jnp.take(biases.up, sorted_experts, axis=0, mode="clip")
    return grouped(ACTIVATIONS[activation](gate, up), w_down)


def grouped_expert_mlp(
    x: jax.Array,  # [T, H]
    routing: Routing,
    w_gate: ExpertWeight,  # [El, I, H]
    w_up: ExpertWeight,  # [El, I, H]
    w_down: ExpertWeight,  # [El, H, I]
    first_expert: jax.Array | int = 0,
    backend: str = "reference",
    cpu_method: str | None = None,
    biases: ExpertBiases | None = None,  # [El, I] each
    activation: str = "silu",
) -> jax.Array:  # [T, H]
    """The experts' contribution to each token, for the `El` experts held here: experts
    `first_expert .. first_expert + El - 1` (all of them when El = E). Pairs routed to
    other experts sort after every local group and contribute zero. `cpu_method` picks
    the grouped matmul off the Triton backend (None: `DEFAULT_CPU_METHOD`); `biases` and
    `activation` (a name in `ACTIVATIONS`) give gpt-oss's experts."""
    cpu_method = DEFAULT_CPU_METHOD if cpu_method is None else cpu_method
    if cpu_method not in CPU_METHODS:
        raise ValueError(f"cpu_method must be one of {CPU_METHODS}, got {cpu_method!r}")
    t, k = routing.experts.shape
    num_local = w_gate.shape[0]
    local = routing.experts - first_expert  # [T, k]
    mine = (local >= 0) & (local < num_local)
    flat = jnp.where(mine, local, num_local).reshape(-1)  # [T*k], others last
    order = jnp.argsort(flat, stable=True)  # [T*k]: pair index, sorted by expert
    group_sizes = jnp.bincount(flat, length=num_local).astype(jnp.int32)  # [El]
    rows = x[order // k]  # [T*k, H]
    sorted_experts = flat[order]  # [T*k]
    weights = (w_gate, w_up, w_down)
    out = _sorted_expert_mlp(
        rows, weights, sorted_experts, group_sizes, backend, cpu_method, biases, activation
    )
    weight = jnp.where(mine, routing.weights, 0.0).reshape(-1)[order]  # [T*k] float32
    # Rows past the local groups were never multiplied: select, never scale, them away.
    valid = sorted_experts < num_local
    out = jnp.where(valid[:, None], out.astype(jnp.float32) * weight[:, None], 0.0)
    unsorted = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # [T*k, H]
    return unsorted.reshape(t, k, -1).sum(axis=1).astype(x.dtype)


def dense_expert_mlp_reference(
    x: jax.Array,  # [T, H]
    routing: Routing,
    w_gate: ExpertWeight,  # [E, I, H]
    w_up: ExpertWeight,
    w_down: ExpertWeight,  # [E, H, I]
) -> jax.Array:  # [T, H]
    """Every expert on every token, combined by one-hot routing weights (tests only);
    quantized experts dequantized first."""
    w_gate, w_up, w_down = (dequantized(w, x.dtype) for w in (w_gate, w_up, w_down))
    num_experts = w_gate.shape[0]
    one_hot = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)  # [T, k, E]
    combine = jnp.einsum("tk,tke->te", routing.weights, one_hot)  # [T, E]
    gate = jnp.einsum("th,eih->tei", x, w_gate)
    up = jnp.einsum("th,eih->tei", x, w_up)
    out = jnp.einsum("tei,ehi->teh", jax.nn.silu(gate) * up, w_down)  # [T, E, H]
    return jnp.einsum("te,teh->th", combine, out.astype(jnp.float32)).astype(x.dtype)


def sharded_expert_mlp(
    x: jax.Array,  # [T, H], replicated
    routing: Routing,  # replicated
    w_gate: ExpertWeight,
    w_up: ExpertWeight,
    w_down: ExpertWeight,
    mesh: Mesh,
    expert_parallel: bool,
    backend: str = "reference",
    biases: ExpertBiases | None = None,
    activation: str = "silu",
) -> jax.Array:  # [T, H], replicated
    """`grouped_expert_mlp` on a `tp` mesh: each device computes a partial sum over what
    it holds, then one all-reduce of `[T, H]` adds them.

    Tensor parallel: every device holds every expert's slice of the intermediate axis
    (gate/up split on I, down on its input I), as a dense MLP is split.

    Expert parallel (gather-compute-reduce): each device holds E / ep whole experts and
    runs the pairs routed to them. Attention is tensor parallel, so every device already
    holds every token's hidden state after its all-reduce: dispatch moves nothing, and
    combine is one all-reduce of `[T, H]`, ring cost `2 T H (ep - 1) / ep` values per
    device. A ragged all-to-all would instead split the tokens (a reduce-scatter of
    attention's output in place of its all-reduce), send each pair's hidden state to its
    expert's device and back (`2 T k H (ep - 1) / ep^2` values), and all-gather before the
    next attention: the all-to-all replaces one all-reduce, so it moves fewer bytes only
    when k < ep. For the models served here k >= ep mostly (Qwen3-30B-A3B: k = 8, ep <= 8;
    at ep = 4 in bfloat16 and H = 2048 the all-reduce sends 96 KiB per device at a
    16-token decode and 12 MiB at a 2048-token prefill, the all-to-all 192 KiB and 24 MiB),
    and the all-reduce needs no per-device capacity buffers sized for the worst routing.
    (Mixtral's k = 2 at ep = 4 is the exception: the all-to-all would move half.) Expert
    weights never move: each device multiplies only the experts it holds.
    """

    def local(x, weights, experts, g, u, d, *bias):
        first = jax.lax.axis_index(AXIS) * g.shape[0] if expert_parallel else 0
        b = ExpertBiases(*bias) if bias else None
        routing = Routing(weights, experts)
        out = grouped_expert_mlp(x, routing, g, u, d, first, backend, None, b, activation)
        return jax.lax.psum(out, AXIS)

    if expert_parallel:
        gate_spec = up_spec = _spec(w_gate, P(AXIS, None, None), P(AXIS, None))
        down_spec = _spec(w_down, P(AXIS, None, None), P(AXIS, None))
        bias_spec = P(AXIS, None)
    else:
        # Scales follow the output channels: split with gate/up's I, whole with down's H.
        gate_spec = up_spec = _spec(w_gate, P(None, AXIS, None), P(None, AXIS))
        down_spec = _spec(w_down, P(None, None, AXIS), P())
        bias_spec = P(None, AXIS)
    bias_args = tuple(biases) if biases is not None else ()
    # Inside a pipeline stage (`pp` already manual) the split is over the context's mesh.
    context = jax.sharding.get_abstract_mesh()
    return jax.shard_map(
        local,
        mesh=context if context.manual_axes else mesh,
        in_specs=(P(), P(), P(), gate_spec, up_spec, down_spec) + (bias_spec,) * len(bias_args),
        out_specs=P(),
        check_vma=False,
    )(x, routing.weights, routing.experts, w_gate, w_up, w_down, *bias_args)


def _spec(w: ExpertWeight, weight: P, scale: P) -> P | QuantizedExperts:
    """`w`'s shard_map spec: its weight's, and for a quantized one its scales' (one
    scale per expert, `[E, 1]`, is split only with the experts)."""
    if not isinstance(w, QuantizedExperts):
        return weight
    if w.scale.shape[1] == 1 and scale != P(AXIS, None):
        scale = P()
    return QuantizedExperts(weight, scale, w.activations)  # type: ignore[arg-type]

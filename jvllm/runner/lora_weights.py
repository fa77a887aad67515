"""The device's LoRA slots: every target layer's adapters stacked for the forward.

Owns `DeviceLoRA`: per target layer A `[N, in, R]` and B `[N, R, out]` (`N =
max_loras`, `R = max_lora_rank`; see `lora/punica.py`), allocated once at start-up,
zeros until an adapter is written, split over a mesh as their base layers are (q/k/v
and gate/up column-parallel: B on its output features; o/down row-parallel: A on its
input features), and `write` (an adapter into a slot, in place: one compiled program
for every adapter and slot). `LoRARunner` is `ModelRunner`'s side of the engine's
`StepRunner` calls. Which adapter goes to which slot, and when, is the engine's
(`engine/lora_slots.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jvllm.lora.config import LoRAConfig
from jvllm.lora.peft_adapter import LoRAModel, TargetKey, module_shapes
from jvllm.lora.punica import LoRAWeights
from jvllm.models.loader import LoadedModel
from jvllm.parallel.loading import repeat_kv_heads
from jvllm.parallel.mesh import AXIS, pp_size
from jvllm.runner.programs import Program

_ROW_PARALLEL = ("o_proj", "down_proj")


def _write_slot(weights: LoRAWeights, index: jax.Array, values: LoRAWeights) -> LoRAWeights:
    """`weights` with slot `index` (0-based) of every stacked array set to `values`."""
    return jax.tree.map(
        lambda w, v: jax.lax.dynamic_update_index_in_dim(w, v.astype(w.dtype), index, 0),
        weights,
        values,
    )


class DeviceLoRA:
    def __init__(self, config: LoRAConfig, loaded: LoadedModel, mesh: Mesh | None) -> None:
        if pp_size(mesh) > 1 or jax.process_count() > 1:
            raise ValueError(
                "enable_lora does not support pipeline_parallel_size > 1 or multi-host runs yet"
            )
        spec = loaded.spec
        self.num_slots, self.rank, self.mesh = config.max_loras, config.max_lora_rank, mesh
        self.dtype = loaded.dtype if config.lora_dtype == "auto" else jnp.dtype(config.lora_dtype)
        # Under tensor parallelism with fewer KV heads than devices the loaded k/v
        # projections repeat each head (`parallel.loading`): an adapter's B does too.
        checkpoint_kv = loaded.hf_config.get("num_key_value_heads", spec.num_kv_heads)
        self.kv_repeats = spec.num_kv_heads // checkpoint_kv
        self.head_dim = spec.head_dim
        self.shapes = module_shapes(spec)  # as the devices hold them
        self.checkpoint_shapes = {
            key: (i, o // self.kv_repeats if key[1] in ("k_proj", "v_proj") else o)
            for key, (i, o) in self.shapes.items()
        }
        n, r = self.num_slots, self.rank
        zeros = {
            _name(key): (np.zeros((n, i, r), self.dtype), np.zeros((n, r, o), self.dtype))
            for key, (i, o) in self.shapes.items()
        }
        self.weights: LoRAWeights = self._place(zeros, self.slot_shardings(stacked=True))
        self.write_program = Program(_write_slot, "lora_write", None, donate_argnames=("weights",))
        self.write(1, None)  # compiles the one write program at start-up

    def slot_shardings(self, stacked: bool) -> dict[str, tuple[Any, Any]] | None:
        """Each target's (A, B) sharding, of the stacked arrays or of one slot's."""
        if self.mesh is None:
            return None
        lead = (None,) if stacked else ()
        out = {}
        for key in self.shapes:
            row = key[1] in _ROW_PARALLEL
            a = P(*lead, AXIS, None) if row else P()
            b = P() if row else P(*lead, None, AXIS)
            out[_name(key)] = (NamedSharding(self.mesh, a), NamedSharding(self.mesh, b))
        return out

    def _place(self, tree: Any, shardings: Any) -> Any:
        if shardings is None:
            return jax.device_put(tree)
        return jax.device_put(tree, shardings)

    def write(self, slot: int, model: LoRAModel | None) -> None:
        """Puts `model` (None: zeros) into device slot `slot` (1..N), queued after every
        step dispatched before (those read the slot's old adapter)."""
        assert 1 <= slot <= self.num_slots, slot
        values = {}
        for key, (i, o) in self.shapes.items():
            a, b = np.zeros((i, self.rank), self.dtype), np.zeros((self.rank, o), self.dtype)
            if model is not None and key in model.weights:
                ma, mb = model.weights[key]  # [in, r], [r, out]
                if self.kv_repeats > 1 and key[1] in ("k_proj", "v_proj"):
                    mb = repeat_kv_heads(mb.T, self.kv_repeats, self.head_dim).T
                a[:, : ma.shape[1]], b[: mb.shape[0]] = ma, mb
            values[_name(key)] = (a, b)
        values = self._place(values, self.slot_shardings(stacked=False))
        self.weights = self.write_program(self.weights, np.int32(slot - 1), values)


def _name(key: TargetKey) -> str:
    return f"{key[0]}.{key[1]}"


class LoRARunner:
    """`ModelRunner`'s LoRA calls (`step_io.StepRunner`); `lora` is None without
    `enable_lora`."""

    lora: DeviceLoRA | None

    @property
    def lora_module_shapes(self) -> dict[TargetKey, tuple[int, int]]:
        """The (in, out) features an adapter's layers must have, as in the checkpoint."""
        assert self.lora is not None
        return self.lora.checkpoint_shapes

    def set_lora(self, slot: int, model: LoRAModel | None) -> None:
        """Writes an adapter (None: zeros) into device slot `slot` (1..max_loras)."""
        assert self.lora is not None
        self.lora.write(slot, model)

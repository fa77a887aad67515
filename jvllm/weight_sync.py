"""The engine inside a training job: new weights, sleep and wake-up, the prefix-cache reset.

Owns `EngineControl`, what vLLM's `LLM` and engine core offer a trainer, over one
`LLMEngine`: `update_weights` (with `start_weight_update` / `finish_weight_update` and
the version they record), `get_weights`, `sleep` / `wake_up` / `is_sleeping`,
`reset_prefix_cache` and `collective_rpc`. It calls them on whatever thread it is
called from: `LLM` calls them between batches, the server's engine thread between steps
(`AsyncLLM.call`). `WeightSync` gives `LLM` these methods. Not owned: the tensors'
placement (`runner.weight_update`), pausing requests in flight (`engine.pause`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jvllm.engine.pause import check_pause_mode
from jvllm.runner.weight_update import DeviceMemory

Weights = str | Path | dict[str, Any] | Iterable[tuple[str, Any]]


class EngineControl:
    """Weight updates and memory release for one engine with no request in flight."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.memory = DeviceMemory(engine.runner)
        self.updating = False  # between start_weight_update and finish_weight_update

    def _check_idle(self, what: str) -> None:
        self._drain()
        if self.engine.has_unfinished_requests():
            raise RuntimeError(
                f"{what} needs an engine with no request in flight; pause generation "
                "(pause_generation(mode='abort' or 'wait')) or let the requests finish first"
            )

    def _drain(self) -> None:
        """Commits a step still queued for requests that have all finished."""
        engine = self.engine
        while engine._in_flight is not None and not engine.output_processor.requests:
            engine.step()

    # -- weights --

    def get_weights(self, draft: bool = False) -> dict[str, Any]:
        return self.memory.get_weights(draft)

    def start_weight_update(self) -> None:
        self._check_idle("start_weight_update")
        self.updating = True

    def update_weights(self, weights: Weights, draft: bool = False) -> int:
        """New weights (see `DeviceMemory.update_weights`); outside a
        start/finish session, the session's start and finish around it."""
        if self.updating:
            return self.memory.update_weights(weights, draft)
        self.start_weight_update()
        try:
            return self.memory.update_weights(weights, draft)
        finally:
            self.finish_weight_update()

    def finish_weight_update(self, weight_version: str | int | None = None) -> None:
        """Ends an update: the prefix cache forgets every block computed with the old
        weights; `weight_version` (if given) is recorded for `get_weight_version()`
        and the metrics."""
        self.updating = False
        self.reset_prefix_cache()
        disk_tier = self.engine.scheduler.kv_cache_manager.disk_tier
        if disk_tier is not None:  # its blocks hold the old weights' K/V too
            disk_tier.new_weights()
        if weight_version is not None:
            self.engine.weight_version = weight_version

    def get_weight_version(self) -> str | int | None:
        return self.engine.weight_version

    # -- memory --

    def sleep(self, level: int = 1) -> None:
        """vLLM's levels: 1 copies the weights to host memory and drops the KV cache; 2
        drops both (`update_weights` then brings weights back); 0 releases nothing."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        if level == 0:
            return
        self._check_idle(f"sleep(level={level})")
        self.memory.sleep(level)
        self.reset_prefix_cache()

    def release_kv_cache_memory(self) -> None:
        """Drops the KV cache (and the step's device buffers), keeping the weights."""
        self._check_idle("release_kv_cache_memory")
        self.memory.release_kv_cache()
        self.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.memory.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.memory.is_sleeping

    def check_serving(self) -> None:
        """Raises unless requests can run (weights and KV cache on the device, no
        weight update open)."""
        if self.updating:
            raise RuntimeError("a weight update is open; call finish_weight_update() first")
        self.memory.check_awake()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (device and host tier); False, and nothing done,
        while a request holds blocks (vLLM's rule)."""
        self._drain()
        return self.engine.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Runs `method` on every worker and returns their results in rank order: a
        callable gets the worker (the `ModelRunner`) first, a name is one of its
        methods. One process: one worker. `timeout` is vLLM's; a local call ignores it."""
        worker = self.engine.runner
        kwargs = kwargs or {}
        if callable(method):
            return [method(worker, *args, **kwargs)]
        if not isinstance(method, str) or not hasattr(worker, method):
            raise ValueError(f"collective_rpc: the worker has no method {method!r}")
        target = getattr(worker, method)
        if not callable(target):  # an attribute (`num_compilations`): its value
            if args or kwargs:
                raise ValueError(f"collective_rpc: {method!r} is not a method; pass no args")
            return [target]
        return [target(*args, **kwargs)]


def engine_devices(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`LLM` keywords with `mesh=` (a `jax.sharding.Mesh`) turned into `devices=` (its
    devices, in order), and `tensor_parallel_size` defaulting to every device given
    (over `pipeline_parallel_size` stages)."""
    mesh = kwargs.pop("mesh", None)
    if mesh is not None:
        if kwargs.get("devices") is not None:
            raise ValueError("give mesh= or devices=, not both")
        if not hasattr(mesh, "devices"):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        kwargs["devices"] = list(mesh.devices.flat)
    devices = kwargs.get("devices")
    if devices is None:
        return kwargs
    devices = kwargs["devices"] = tuple(devices)
    pp = int(kwargs.get("pipeline_parallel_size", 1))
    if not devices or len(devices) % pp:
        raise ValueError(
            f"devices: {len(devices)} device(s) cannot hold pipeline_parallel_size={pp} stages"
        )
    kwargs.setdefault("tensor_parallel_size", len(devices) // pp)
    return kwargs


def control_of(engine: Any) -> EngineControl:
    """The one `EngineControl` of `engine`, made on first use."""
    control = getattr(engine, "_control", None)
    if control is None:
        control = engine._control = EngineControl(engine)
    return control


class WeightSync:
    """`LLM`'s methods for a trainer (vLLM's names); see `EngineControl`."""

    engine: Any

    @property
    def _control(self) -> EngineControl:
        return control_of(self.engine)

    def get_weights(self, draft: bool = False) -> dict[str, Any]:
        """The engine's parameter tree: its layout, dtypes and shardings."""
        return self._control.get_weights(draft)

    def update_weights(self, weights: Weights, draft: bool = False) -> int:
        """New weights from a checkpoint directory, (Hugging Face name, array) pairs, or
        a tree shaped as `get_weights()`'s; no recompilation; prefix cache reset."""
        return self._control.update_weights(weights, draft)

    def start_weight_update(self) -> None:
        self._control.start_weight_update()

    def finish_weight_update(self, weight_version: str | int | None = None) -> None:
        self._control.finish_weight_update(weight_version)

    def get_weight_version(self) -> str | int | None:
        return self._control.get_weight_version()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's levels (see `EngineControl.sleep`). `mode` is vLLM's pause mode: between
        `generate` calls nothing is in flight, so it only has to be valid here."""
        check_pause_mode(mode)
        self._control.sleep(level)

    def release_kv_cache_memory(self) -> None:
        """The KV cache released, the weights kept; `wake_up(tags=["kv_cache"])` undoes it."""
        self._control.release_kv_cache_memory()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._control.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self._control.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self._control.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self._control.collective_rpc(method, timeout, args, kwargs)

"""LoRASlots: which LoRA adapter sits in which device slot, and the host cache of read
adapters (vLLM's LRU LoRA managers, on the host side).

Owns reading an adapter when a request (or `add_lora`) first names it, checked against
the model before the request enters (`lora/peft_adapter.py`), and keeping up to
`max_cpu_loras` read adapters in host memory, least recently used evicted first (never
one that a waiting or running request uses: `hold` / `release`); and,
each step, placing the step's adapters in the `max_loras` device slots (slot 0 is the
base model), evicting the least recently used slot whose adapter the step does not
use, and giving each row its slot (`SchedulerOutput.lora_slots`). The scheduler admits
no more distinct adapters than there are slots (`admission.py`). The device arrays are
the runner's (`StepRunner.set_lora`).

`add_lora`, `remove_lora` and `list_loras` may be called from any thread (the server
reads an adapter off the engine thread, so that a step never waits for its files); the
rest runs on the engine's thread.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jvllm.engine.step_io import SchedulerOutput, StepRunner
from jvllm.lora.config import LoRAConfig
from jvllm.lora.peft_adapter import LoRAModel, load_peft_adapter
from jvllm.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, config: LoRAConfig, runner: StepRunner) -> None:
        self.config = config
        self.runner = runner
        self.shapes = runner.lora_module_shapes
        # Read adapters by id, least recently used first.
        self._host: OrderedDict[int, LoRAModel] = OrderedDict()
        self._requests: dict[int, LoRARequest] = {}  # every adapter named so far, by id
        # Device slot s (1..max_loras) holds adapter _slots[s - 1] (None: empty).
        self._slots: list[int | None] = [None] * config.max_loras
        self._last_used = [0] * config.max_loras  # the step that last used each slot
        self._step = 0
        self._lock = threading.Lock()  # guards _host, _requests, _removed and _held
        self._removed: set[int] = set()  # adapters removed since the last step
        # Request id -> its adapter, from its arrival to its end; the host cache keeps
        # every adapter a request holds, so a step never reads one from disk.
        self._live: dict[str, int] = {}
        self._held: Counter[int] = Counter()
        self.num_reads = 0  # adapters read from disk
        self.num_device_loads = 0  # adapters written into a device slot

    def add_lora(self, request: LoRARequest) -> LoRAModel:
        """The adapter read (from the host cache, else from disk), checked: raises
        `LoRAAdapterError` naming what is wrong. One id keeps one name and path."""
        lora_int_id = request.lora_int_id
        with self._lock:
            known = self._requests.get(lora_int_id)
            if known is not None and (known.lora_name, known.lora_path) != (
                request.lora_name,
                request.lora_path,
            ):
                raise ValueError(
                    f"lora_int_id {lora_int_id} is already adapter {known.lora_name!r} "
                    f"({known.lora_path}); give {request.lora_name!r} an id of its own"
                )
            model = self._host.get(lora_int_id)
        if model is None:  # read outside the lock: other threads go on meanwhile
            max_rank = self.config.max_lora_rank
            model = load_peft_adapter(request.lora_path, lora_int_id, max_rank, self.shapes)
        with self._lock:
            if lora_int_id not in self._host:
                self.num_reads += 1
                self._host[lora_int_id] = model
            self._host.move_to_end(lora_int_id)
            self._requests[lora_int_id] = request
            self._trim_host(keep=lora_int_id)
        return model

    def _trim_host(self, keep: int) -> None:
        """Evicts least recently used adapters that no request holds, but `keep` (just
        read for a request about to hold it), down to max_cpu_loras (lock held)."""
        excess = len(self._host) - self.config.host_capacity
        spare = [i for i in self._host if not self._held[i] and i != keep]
        for lora_int_id in spare[: max(excess, 0)]:
            del self._host[lora_int_id]

    def hold(self, request_id: str, lora_int_id: int) -> None:
        """A request (one sequence) runs with the adapter until `release`."""
        with self._lock:
            self._live[request_id] = lora_int_id
            self._held[lora_int_id] += 1

    def release(self, request_id: str) -> None:
        """A sequence ended (finished or aborted); no-op for one without an adapter."""
        with self._lock:
            lora_int_id = self._live.pop(request_id, None)
            if lora_int_id is not None:
                self._held[lora_int_id] -= 1
                if not self._held[lora_int_id]:
                    del self._held[lora_int_id]

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter (host cache and device slot); False if it was unknown.
        A request still running with it reads it again from its path."""
        with self._lock:
            known = self._requests.pop(lora_int_id, None) is not None
            if not self._held[lora_int_id]:  # else its requests finish with it
                self._host.pop(lora_int_id, None)
            self._removed.add(lora_int_id)  # its slot is emptied by the next step
        return known

    def list_loras(self) -> list[int]:
        """The ids of the adapters read and not removed."""
        with self._lock:
            return sorted(self._requests)

    def assign_slots(self, sched: SchedulerOutput, states: Sequence[Any]) -> SchedulerOutput:
        """`sched` with each row's device slot, after writing the adapters it needs that
        no slot holds (`states`: the rows' sequence states, `.request` each)."""
        self._step += 1
        with self._lock:
            removed, self._removed = self._removed, set()
        self._slots = [None if held in removed else held for held in self._slots]
        loras = [state.request.lora_request for state in states]  # per row, None: base
        wanted = {r.lora_int_id: r for r in loras if r is not None}
        assert len(wanted) <= len(self._slots), "the scheduler admits at most max_loras"
        slot_of = {}
        for lora_int_id, request in wanted.items():
            if lora_int_id in self._slots:
                slot = self._slots.index(lora_int_id) + 1
            else:
                slot = self._load(request, wanted)
            self._last_used[slot - 1] = self._step
            slot_of[lora_int_id] = slot
        slots = np.array([0 if r is None else slot_of[r.lora_int_id] for r in loras], np.int32)
        return dataclasses.replace(sched, lora_slots=slots)

    def _load(self, request: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        """Writes `request`'s adapter into an empty slot, else into the least recently
        used slot holding none of `wanted`; its slot."""
        free = [i for i, held in enumerate(self._slots) if held is None or held not in wanted]
        index = min(free, key=lambda i: (self._slots[i] is not None, self._last_used[i]))
        model = self.add_lora(request)
        self.runner.set_lora(index + 1, model)
        self._slots[index] = request.lora_int_id
        self.num_device_loads += 1
        return index + 1

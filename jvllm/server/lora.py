"""LoRA adapters over HTTP: `--lora-modules`, the served adapters by name, and
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` (vLLM's routes).

Owns the registry of served adapters (name -> `LoRARequest`, each load a fresh
`lora_int_id`, so a name loaded again never meets its old weights), choosing a request's
adapter by its `model`, the adapters' `/v1/models` cards (each with its `parent`), and
the two routes, served only when runtime updates are allowed
(`lora_args.runtime_updating_allowed`). An adapter
is read and checked off the engine thread (`LLMEngine.add_lora` in a worker thread)
before its name is served: a bad one is a 400 naming what is wrong.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jvllm.lora.request import LoRARequest

from .errors import APIError
from .lora_args import LoRAModulePath, runtime_updating_allowed


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class ServedLoRAs:
    """The adapters served by name; `engine` is the `LLMEngine` (its `add_lora` and
    `remove_lora` are thread-safe)."""

    def __init__(self, engine: Any, base_model_name: str, runtime_updates: bool = False) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.runtime_updates = runtime_updates  # the load and unload routes are served
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.engine.lora_slots is not None

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def requests(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def load_now(self, module: LoRAModulePath) -> LoRARequest:
        """Reads, checks and serves an adapter (start-up); ValueError when it is bad."""
        if not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        if module.name in self._by_name:
            raise ValueError(f"The lora adapter '{module.name}' has already been loaded.")
        with self._lock:
            lora_int_id = next(self._ids)
        base = module.base_model_name or self.base_model_name
        request = LoRARequest(module.name, lora_int_id, module.path, base)
        self.engine.add_lora(request)
        self._by_name[module.name] = request
        return request

    async def load(self, name: str, path: str) -> LoRARequest:
        """`load_now` in a worker thread (the engine thread goes on); 400 when bad."""
        if not name or not path:
            raise APIError(400, "lora_name and lora_path must both be non-empty", param="lora_name")
        try:
            return await asyncio.to_thread(self.load_now, LoRAModulePath(name, path))
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None

    def unload(self, name: str) -> None:
        request = self._by_name.pop(name, None)
        if request is None:
            raise APIError(400, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self.engine.remove_lora(request.lora_int_id)


def served_loras(
    engine: Any, base_model_name: str, modules: Sequence[LoRAModulePath], allow: bool | None
) -> ServedLoRAs | None:
    """The `--lora-modules` adapters read and served (None without `--enable-lora`);
    ValueError naming a bad one, before the server starts."""
    if engine.lora_slots is None:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    loras = ServedLoRAs(engine, base_model_name, runtime_updating_allowed(allow))
    for module in modules:
        loras.load_now(module)
    return loras


async def load_lora_adapter(loras: ServedLoRAs, request: Request, max_bytes: int) -> Response:
    from .serving import parse_body

    body = await parse_body(request, LoadLoRAAdapterRequest, max_bytes)
    await loras.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(loras: ServedLoRAs, request: Request, max_bytes: int) -> Response:
    from .serving import parse_body

    body = await parse_body(request, UnloadLoRAAdapterRequest, max_bytes)
    loras.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

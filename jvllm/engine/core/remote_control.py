"""RemoteControl: `weight_sync.EngineControl`'s calls (sleep, wake-up, weight updates,
collective RPCs) run on every engine core through an `EngineCoreClient`'s utility calls,
for the server's dev routes. Not owned: the sockets and the calls themselves
(`client.py`), what the cores do with them (`core.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jvllm.engine.core.client import EngineCoreClient


class RemoteControl:
    """`weight_sync.EngineControl`'s calls, run on every engine core (dev routes)."""

    def __init__(self, client: EngineCoreClient) -> None:
        self._client = client
        self.memory = self  # `control.memory.update_weights(path)`

    def sleep(self, level: int = 1) -> None:
        self._client.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._client.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return all(self._client.call_utility("is_sleeping"))

    def reset_prefix_cache(self) -> bool:
        return self._client.reset_prefix_cache()

    def collective_rpc(self, method: str, timeout: Any, args: Any, kwargs: Any) -> list[Any]:
        results = self._client.call_utility("collective_rpc", method, timeout, args, kwargs)
        return [r for per_core in results for r in per_core]

    def start_weight_update(self) -> None:
        self._client.call_utility("start_weight_update")

    def update_weights(self, model_path: str) -> int:
        return self._client.call_utility("update_weights", model_path)[0]

    def finish_weight_update(self, weight_version: str | int | None = None) -> None:
        self._client.call_utility("finish_weight_update", weight_version)

    def get_weight_version(self) -> str | int | None:
        return self._client.call_utility("get_weight_version")[0]

    def weight_info(self) -> dict[str, Any]:
        return self._client.call_utility("weight_info")[0]

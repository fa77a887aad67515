"""MultiprocEngine: the offline `LLM`'s engine in an engine-core process, as an
`EngineCoreClient` that also owns its core process (stopped by `shutdown`, or at exit)
and takes `LLM`'s `step(final_only)`. Not owned: the wire (`messages.py`), the core
(`core.py`), when it is used (`offline.py`).
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

from jvllm.engine.core.client import EngineCoreClient, RemoteControl
from jvllm.engine.core.launcher import EngineCoreProcs
from jvllm.outputs import RequestOutput


class MultiprocEngine(EngineCoreClient):
    """An engine core process and the client of it, for `LLM`."""

    def __init__(self, engine_args: Any) -> None:
        from jvllm.tokenizer_loading import load_tokenizer

        self._procs: EngineCoreProcs | None = EngineCoreProcs(engine_args, 1)
        atexit.register(self.shutdown)
        try:
            tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model)
            super().__init__(self._procs.addresses_for(0), self._procs.pids, tokenizer)
        except BaseException:
            self._procs.stop()
            self._procs = None
            raise
        self._control = OfflineControl(self)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        arrival_time: float | None = None,
        **kwargs: Any,
    ) -> None:
        arrival = time.monotonic() if arrival_time is None else arrival_time
        super().add_request(request_id, prompt, params, arrival, **kwargs)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        outputs = super().step()
        return [out for out in outputs if out.finished] if final_only else outputs

    def shutdown(self) -> None:
        """Stops the core process (idempotent)."""
        if self._procs is not None:
            self._procs.stop()
            self.close()
            self._procs = None
            self.structured_outputs.shutdown()


class OfflineControl(RemoteControl):
    """`RemoteControl` with `LLM`'s check before each batch."""

    def check_serving(self) -> None:
        if self.is_sleeping():
            raise RuntimeError("the engine is asleep; call wake_up() first")

    def get_weights(self, draft: bool = False) -> Any:
        raise RuntimeError(_NO_ARRAYS)

    def update_weights(self, weights: Any, draft: bool = False) -> int:  # type: ignore[override]
        """New weights from a checkpoint directory (arrays stay in this process)."""
        if draft or not isinstance(weights, str | os.PathLike):
            raise RuntimeError(_NO_ARRAYS)
        return self._client.call_utility("update_weights_whole", str(weights))[0]


_NO_ARRAYS = (
    "weights as arrays (and the draft model's) do not cross to the engine-core process: "
    "pass a checkpoint directory, or use the in-process engine "
    "(JVLLM_ENABLE_V1_MULTIPROCESSING=0)"
)

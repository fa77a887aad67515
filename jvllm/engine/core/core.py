"""EngineCore: one engine in a process of its own, serving front ends over zmq sockets it
connects out to (vLLM's `EngineCoreProc`).

Owns the engine (`LLMEngine`: scheduler, KV manager, runner, and committing each step's
tokens) inside the core process, and the loop that answers the front ends' messages
(`messages.py`) one at a time: add a tokenized request, abort, step, a utility call.
The engine stops sequences on EOS, stop token ids and lengths only, and reports token
ids: detokenizing and stop strings are the front end's (`detokenizing.py`).
Several front ends (`--api-server-count`) may share one core: each request's outputs go
to the front end that added it, buffered until that front end next asks for a step.
Tokenizing, detokenizing, building RequestOutputs, the streams and HTTP are the front
end's (`client.py`). The engine is built here, so the runner (and jax) is imported only once
this process runs: the module itself imports no jax.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
from collections import defaultdict
from collections.abc import Callable
from socket import gethostname
from typing import Any

import msgspec

from jvllm.engine.core import messages as m
from jvllm.engine.validation import InvalidRequestError
from jvllm.lora.request import LoRARequest
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import RequestOutputKind

logger = logging.getLogger("jvllm.engine_core")

# Seconds between checks, while idle, that the process that started this core is alive.
PARENT_CHECK_S = 1.0


def _control(engine: Any) -> Any:
    from jvllm.weight_sync import control_of  # the weights' side imports jax

    return control_of(engine)


def _update_weights(engine: Any, model_path: str) -> int:
    return _control(engine).memory.update_weights(model_path)


def _weight_info(engine: Any) -> dict[str, Any]:
    from jvllm.server.dev_routes import _weight_info as info

    return info(engine)


# vLLM's utility calls: the engine methods a front end may call by name.
UTILITIES: dict[str, Callable[..., Any]] = {
    "add_lora": lambda e, lora: e.add_lora(msgspec.convert(lora, LoRARequest)),
    "remove_lora": lambda e, lora_int_id: e.remove_lora(int(lora_int_id)),
    "list_loras": lambda e: sorted(e.list_loras()),
    "reset_prefix_cache": lambda e: e.reset_prefix_cache(),
    "get_metrics": lambda e: dict(e.get_metrics()),
    "sleep": lambda e, level: _control(e).sleep(int(level)),
    "wake_up": lambda e, tags: _control(e).wake_up(tags),
    "is_sleeping": lambda e: _control(e).is_sleeping(),
    "collective_rpc": lambda e, *args: _control(e).collective_rpc(*args),
    "start_weight_update": lambda e: _control(e).start_weight_update(),
    "update_weights": _update_weights,
    "update_weights_whole": lambda e, path: _control(e).update_weights(path),
    "finish_weight_update": lambda e, version: _control(e).finish_weight_update(version),
    "get_weight_version": lambda e: _control(e).get_weight_version(),
    "weight_info": _weight_info,
}


class EngineCore:
    """Answers one front-end message at a time (`handle`); the process loop is `run`."""

    def __init__(self, engine: Any, engine_index: int, detokenize: bool = False) -> None:
        """`detokenize` False (as vLLM's core): outputs carry token ids (and logprobs)
        only, and no stop string ends a sequence here; the front end does both
        (`detokenizing.py`) and aborts a request a stop string ended."""
        self.engine = engine
        engine.output_processor.detokenize = detokenize
        self.engine_index = engine_index
        self._owner: dict[str, bytes] = {}  # request id -> the front end that added it
        self._pending: dict[bytes, list[m.WireOutput]] = defaultdict(list)
        self._ahead = False  # a step ran ahead of the next Step (prefetch)
        self._prefetch = False  # the last Step asked for one
        self.num_added = 0  # requests taken (the DP coordinator's view tells them apart)
        self._loads: Any = None  # a LoadPusher to the DP coordinator, when there is one

    def info(self) -> m.EngineCoreInfo:
        engine = self.engine
        return m.EngineCoreInfo(
            engine_index=self.engine_index,
            pid=os.getpid(),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_ids=sorted(engine.eos_token_ids),
            supported_tasks=list(getattr(engine, "supported_tasks", ("generate",))),
            lora_enabled=getattr(engine, "lora_slots", None) is not None,
            scheduling_policy=engine.config.scheduler_config.scheduling_policy,
            cache_config=dataclasses.asdict(engine.config.cache_config),
            metrics=dict(engine.get_metrics()),
            hostname=gethostname(),
        )

    def handle(self, client: bytes, message: m.Request) -> msgspec.Struct | None:
        """The reply to `message` from front end `client` (None: it takes none)."""
        if isinstance(message, m.Step):
            return self.step(client, message.prefetch)
        if isinstance(message, m.AddRequest):
            return self.add_request(client, message)
        if isinstance(message, m.Abort):
            aborted = set(message.request_ids)
            for request_id in aborted:
                if self._owner.pop(request_id, None) is not None:
                    self.engine.abort_request(request_id)
            # Outputs a run-ahead step made for them: a reused id must not receive them.
            pending = self._pending.get(client)
            if pending:
                pending[:] = [out for out in pending if out.request_id not in aborted]
            for request_id, indices in message.choices.items():
                if self._owner.get(request_id) == client:
                    self._end_choices(request_id, indices)
            return m.UtilityReply(result=dict(self.engine.get_metrics()))
        if isinstance(message, m.UtilityCall):
            return self.call_utility(message)
        assert isinstance(message, m.Hello), message
        return self.info()

    def _end_choices(self, request_id: str, indices: list[int]) -> None:
        """Frees the sequences of choices its front end ended; the request's last output
        goes out with the next step's if that ended it."""
        engine = self.engine
        commit = engine.output_processor.abort_sequences(request_id, indices)
        engine._apply(commit)  # the scheduler frees their blocks
        for output in commit.outputs:
            self._pending[self._owner.pop(request_id)].append(_wire(output))

    def add_request(self, client: bytes, add: m.AddRequest) -> m.AddReply:
        params = add.beam_search_params
        if add.sampling_params is not None:
            params = add.sampling_params.clone(output_kind=RequestOutputKind.DELTA)
        prompt = {"prompt": add.prompt, "prompt_token_ids": add.prompt_token_ids}
        extra: dict[str, Any] = {"priority": add.priority} if add.priority else {}
        if add.lora_request is not None:
            extra["lora_request"] = add.lora_request
        try:
            self.engine.add_request(add.request_id, prompt, params, add.arrival_time, **extra)
        except InvalidRequestError as e:
            return m.AddReply(str(e), e.param, "InvalidRequestError")
        except (ValueError, TypeError) as e:
            return m.AddReply(str(e))
        self._owner[add.request_id] = client
        self.num_added += 1
        return m.AddReply(num_added=self.num_added)

    def step(self, client: bytes, prefetch: bool = False) -> m.StepReply:
        """Runs one engine step (unless one ran ahead) and hands `client` its outputs."""
        if not self._ahead:
            self._run_step()
        self._ahead, self._prefetch = False, prefetch
        outputs = self._pending.pop(client, [])
        return m.StepReply(outputs, dict(self.engine.get_metrics()))

    def run_ahead(self) -> None:
        """After a Step's reply went out: the next step now, if it asked for one, so that
        the core steps while the front end handles the outputs (no idle round trip)."""
        if self._prefetch and self.engine.has_unfinished_requests():
            self._run_step()
            self._ahead = True
        self._prefetch = False

    def _run_step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        for output in self.engine.step():
            owner = self._owner.get(output.request_id)
            if owner is None:
                continue  # aborted by its front end, which no longer waits for it
            if output.finished:
                del self._owner[output.request_id]
            self._pending[owner].append(_wire(output))

    def call_utility(self, call: m.UtilityCall) -> m.UtilityReply:
        fn = UTILITIES.get(call.method)
        if fn is None:
            return m.UtilityReply(error=f"no utility {call.method!r}", error_type="ValueError")
        try:
            return m.UtilityReply(result=_plain(fn(self.engine, *call.args)))
        except Exception as e:  # noqa: BLE001 - the caller gets it, the core carries on
            # The nearest built-in kind, which the client raises again (LoRAAdapterError
            # is a ValueError: a 400).
            kind = next(k for k in type(e).__mro__ if k.__module__ == "builtins")
            return m.UtilityReply(error=str(e), error_type=kind.__name__)

    def push_load(self) -> None:
        """Tells the DP coordinator this core's load, if it changed since the last push
        that went out."""
        if self._loads is not None:
            scheduler = self.engine.scheduler
            self._loads.push(len(scheduler.waiting), len(scheduler.running), self.num_added)

    def run(
        self, frontends: list[str], loads_address: str | None = None, ready: Any = None
    ) -> None:
        """Connects out to each front end's socket at `frontends` (as vLLM: the front ends
        bind, so a core on another host needs no port of its own), sends each its info,
        says it serves on `ready` (a pipe to the process that started it), then answers
        the front ends until told to shut down, or until that process is gone; pushes
        its load to the DP coordinator at `loads_address`, if given."""
        import zmq

        from jvllm.engine.core.coordinator import LoadPusher

        parent = os.getppid()
        context = zmq.Context()
        sockets = [_connect(context, address) for address in frontends]
        info = m.encode(self.info())
        for socket in sockets:
            socket.send(info)  # a front end reads it before anything else
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, zmq.POLLIN)
        if loads_address is not None:
            self._loads = LoadPusher(context, loads_address, self.engine_index)
        if ready is not None:
            ready.send(os.getpid())
            ready.close()
        try:
            while True:
                events = poller.poll(int(PARENT_CHECK_S * 1000))
                if not events:
                    if os.getppid() != parent:
                        logger.error("engine core %d: its parent left; exiting", self.engine_index)
                        return
                    self.push_load()  # one the coordinator could not take yet: no stale row

                for socket, _ in events:
                    client = sockets.index(socket).to_bytes(2, "little")
                    if not self._answer(socket, client):
                        return
        finally:
            if self._loads is not None:
                self._loads.close()
            for socket in sockets:
                socket.close()
            context.term()

    def _answer(self, socket: Any, client: bytes) -> bool:
        """Handles one message from front end `client`; False once told to shut down."""
        message = m.decode_request(socket.recv(copy=False).bytes)
        if isinstance(message, m.Shutdown):
            return False
        reply = self.handle(client, message)
        if reply is not None:
            socket.send(m.encode(reply), copy=False)
        self.push_load()
        if isinstance(message, m.Step):
            self.run_ahead()
            self.push_load()
        return True


def _connect(context: Any, address: str) -> Any:
    """A DEALER to a front end's socket; over TCP (another host) with heartbeats, so that
    a silent connection is dropped and both sides see it."""
    import zmq

    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://"):
        from jvllm.engine.core.connection import with_heartbeat

        with_heartbeat(socket)
    socket.connect(address)
    return socket


def _wire(output: RequestOutput) -> m.WireOutput:
    return m.WireOutput(
        output.request_id,
        output.outputs,
        output.finished,
        output.prompt_logprobs,
        output.num_cached_tokens,
    )


def _plain(value: Any) -> Any:
    """A utility's result as msgpack can carry it (sets as sorted lists, others by repr)."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    try:
        m.encode(m.UtilityReply(result=value))
    except (TypeError, msgspec.EncodeError):
        return repr(value)
    return value


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux's PR_SET_PDEATHSIG), also while
    the engine builds, before `run` can watch the parent."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_engine_core(
    engine_args: Any,
    engine_index: int,
    frontends: list[str],
    devices: str,
    loads_address: str | None = None,
    ready: Any = None,
) -> None:
    """The core process's entry (`launcher.py` starts it): build the engine on this
    rank's devices, then serve the front ends at `frontends` (pushing its load to the DP
    coordinator at `loads_address`, if any; saying so on the pipe `ready`). SIGINT is
    left to the parent, which stops the cores."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s EngineCore_DP{engine_index} %(message)s"
    )
    engine = engine_args.create_engine()
    logger.info("engine core %d (pid %d) serving %s", engine_index, os.getpid(), frontends)
    EngineCore(engine, engine_index).run(frontends, loads_address, ready)

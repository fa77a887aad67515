"""EngineCoreClient: the front end's view of one or more engine-core processes, in the
shape of `LLMEngine` that `AsyncLLM` drives (vLLM's `EngineCoreClient` with its
data-parallel load balancing).

Owns, in the front end: one socket per core, bound here for the core to connect to (as
vLLM: a core on another host needs no port of its own), tokenizing prompts and checking
requests before they leave (`validation.py`, so a bad one is a 400 without a round
trip), choosing a data-parallel engine core for each request (the least `waiting * 4 +
running`, vLLM's coordinator's score, by the DP coordinator's table of every core's
load where several API servers share the cores: `coordinator.py`), turning the cores'
token ids into RequestOutputs (`detokenizing.py`: text, stop strings, cumulative or
delta as the request asked) and aborting in its core a request that a stop string
ended, the engine metrics of every core, utility calls (broadcast to every core), and
noticing a dead core: the step that waits on it raises `EngineCoreDeadError` naming it,
which `AsyncLLM` turns into a failure of every in-flight request. Every call runs on
the one AsyncLLM engine thread, as `LLMEngine`'s would. Not owned: starting or stopping
the core processes (`launcher.py`), the engine itself (`core.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from jvllm.engine.async_llm import EngineDeadError
from jvllm.engine.core import messages as m
from jvllm.engine.core.detokenizing import FrontendOutputProcessor
from jvllm.engine.core.remote_control import RemoteControl
from jvllm.engine.structured_output import GrammarCompiler
from jvllm.engine.validation import InvalidRequestError, check_priority, validate_request
from jvllm.lora.request import LoRARequest
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("jvllm.engine_core")
# Milliseconds between liveness checks of a core while waiting for its reply.
POLL_MS = 100
# vLLM's coordinator scores an engine's load as waiting * 4 + running.
WAITING_WEIGHT = 4
_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, TypeError, FileNotFoundError, RuntimeError, KeyError)
}


class EngineCoreDeadError(EngineDeadError):
    """An engine-core process exited; its message names the core and its exit."""


@dataclass
class _Core:
    index: int
    pid: int
    # Bound here, the core's DEALER connected to it: a zmq DEALER, or for a core on
    # another host a ROUTER that talks with the core alone (`connection.PeerSocket`).
    socket: Any
    info: m.EngineCoreInfo | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)  # this front end's, in flight there
    # Sequences added since its last step reply, not yet in its metrics, as the core's
    # scheduler counts them (`queued_requests`).
    added: int = 0
    # With a DP coordinator: the core's load as every API server sees it, and this front
    # end's adds that it may not show yet: (the core's count of requests taken with this
    # one, its sequences).
    shared: m.EngineLoad | None = None
    own_adds: list[tuple[int, int]] = field(default_factory=list)
    # A core on another host (tcp): its connection's watch, as its pid is not ours to see.
    watch: Any = None
    address: str = ""  # bound here; the core connects to it
    host: str = ""  # the host it runs on (from its info)

    @property
    def name(self) -> str:
        where = f" on {self.host}" if self.watch is not None and self.host else ""
        return f"engine core {self.index} (pid {self.pid}{where})"

    def exit_status(self) -> str | None:
        """None while the core runs; else how it ended."""
        if self.watch is not None:
            return self.watch.lost()
        return process_exit_status(self.pid)

    def load(self) -> int:
        """vLLM's score: waiting * 4 + running, in sequences."""
        shared = self.shared
        if shared is None:
            waiting = self.metrics.get("num_requests_waiting", 0) + self.added
            return waiting * WAITING_WEIGHT + self.metrics.get("num_requests_running", 0)
        unseen = sum(seqs for taken, seqs in self.own_adds if taken > shared.num_added)
        return (shared.waiting + unseen) * WAITING_WEIGHT + shared.running


class EngineCoreClient:
    """`LLMEngine`'s methods, answered by engine cores that connect to `addresses` (bound
    here, one per DP rank)."""

    def __init__(
        self,
        addresses: list[str],
        pids: list[int],
        tokenizer: Any,
        loads_address: str | None = None,
    ) -> None:
        """`loads_address`: the DP coordinator's table of every core's load, which
        balancing then uses (several API servers); else each core's metrics."""
        import zmq

        self._context = zmq.Context()
        # The sockets' one user at a time: the engine thread, or a LoRA load's worker.
        self._lock = threading.RLock()
        self.cores: list[_Core] = []
        self._loads: Any = None
        try:  # a failure closes what was opened (ports, watches, the coordinator's view)
            self._setup(tokenizer, self._connect(addresses, pids, loads_address))
        except BaseException:
            self.close()
            raise

    def _connect(
        self, addresses: list[str], pids: list[int], loads_address: str | None
    ) -> m.EngineCoreInfo:
        """Binds one socket per core, reads each core's info and checks they are alike;
        the first core's info."""
        for index, (address, pid) in enumerate(zip(addresses, pids, strict=True)):
            self.cores.append(_bind(self._context, index, pid, address))
        if loads_address is not None:
            from jvllm.engine.core.coordinator import LoadView

            self._loads = LoadView(self._context, loads_address)
        infos = [self._first_info(core) for core in self.cores]
        for core, info in zip(self.cores, infos, strict=True):
            core.info, core.metrics, core.host = info, info.metrics, info.hostname
        _check_alike(infos)
        return infos[0]

    def _setup(self, tokenizer: Any, first: m.EngineCoreInfo) -> None:
        """What the front end takes from the cores' info (alike on every core)."""
        self.tokenizer = tokenizer
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.eos_token_ids = frozenset(first.eos_token_ids)
        self.supported_tasks = tuple(first.supported_tasks)
        self.cache_config = first.cache_config
        self.lora_slots = True if first.lora_enabled else None  # LoRA on: what the server asks
        self._policy = first.scheduling_policy
        self.structured_outputs = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self._requests: dict[str, _Core] = {}  # request id -> the core running it
        # Detokenizes the cores' token ids, applies stop strings, builds the outputs.
        self.output_processor = FrontendOutputProcessor(tokenizer, self.eos_token_ids)
        # Whether the cores may run a step ahead (not while a pause holds the requests:
        # the server sets it from AsyncLLM's pause state).
        self.may_prefetch: Callable[[], bool] = lambda: True
        self._control = RemoteControl(self)  # what `weight_sync.control_of` finds

    # -- requests --

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Tokenizes and checks the request here, then adds it to the least loaded core;
        raises ValueError (InvalidRequestError) as `LLMEngine.add_request` does."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority, self._policy)
        text, ids = _tokenize(self.tokenizer, prompt)
        beam = isinstance(params, BeamSearchParams)
        if not beam:
            validate_request(text, ids, params, self.vocab_size, self.max_model_len)
        core = self._least_loaded()
        add = m.AddRequest(request_id, text, ids, arrival_time, priority=priority)
        add.lora_request = lora_request
        if beam:
            add.beam_search_params = params
        else:
            add.sampling_params = params
        reply = self._call(core, add, m.AddReply)
        if reply.error is not None:
            if reply.error_type == "InvalidRequestError":
                raise InvalidRequestError(reply.error, reply.param)
            raise ValueError(reply.error)
        self.output_processor.add_request(request_id, text, ids, params, lora_request)
        self._requests[request_id] = core
        core.requests.add(request_id)
        sequences = queued_requests(params)
        core.added += sequences
        if self._loads is not None:
            core.own_adds.append((reply.num_added, sequences))

    def _least_loaded(self) -> _Core:
        """The core to add to: the least `waiting * 4 + running`, by the DP coordinator's
        newest table where there is one."""
        table = self._loads.latest() if self._loads is not None else None
        if table is not None:
            for core, load in zip(self.cores, table.engines, strict=True):
                if load is not None:
                    core.shared = load
                    core.own_adds = [add for add in core.own_adds if add[0] > load.num_added]
        return min(self.cores, key=_Core.load)

    def abort_request(self, request_id: str) -> None:
        core = self._requests.pop(request_id, None)
        if core is None:
            return
        self.output_processor.abort_request(request_id)
        core.requests.discard(request_id)
        reply = self._call(core, m.Abort([request_id]), m.UtilityReply)
        core.metrics = reply.result

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """One step of every core this front end has requests on (of every core when it
        has none: a pause's flush), run side by side; their outputs."""
        cores = [core for core in self.cores if core.requests] or self.cores
        with self._lock:
            step = m.encode(m.Step(prefetch=self.may_prefetch()))
            for core in cores:
                core.socket.send(step)
            replies = [self._receive(core, m.StepReply) for core in cores]
        outputs: list[RequestOutput] = []
        for core, reply in zip(cores, replies, strict=True):
            core.metrics, core.added = reply.metrics, 0
            # Requests and choices stop strings ended here: the core still runs them.
            stopped, choices = [], {}
            for wire in reply.outputs:
                output, abort_in_core, ended = self.output_processor.process(wire)
                if abort_in_core:
                    stopped.append(wire.request_id)
                elif ended:
                    choices[wire.request_id] = ended
                if output is None:
                    continue
                outputs.append(output)
                if output.finished:
                    del self._requests[wire.request_id]
                    core.requests.discard(wire.request_id)
            if stopped or choices:  # the core frees their blocks now
                abort = m.Abort(stopped, choices)
                core.metrics = self._call(core, abort, m.UtilityReply).result
        return outputs

    # -- metrics and utilities --

    def get_metrics(self) -> dict[str, Any]:
        """The cores' metrics summed (per-engine ones under "engines", by DP rank)."""
        per_engine = [core.metrics for core in self.cores]
        total: dict[str, Any] = {}
        for metrics in per_engine:
            for key, value in metrics.items():
                total[key] = _add(total[key], value) if key in total else value
        if "kv_cache_usage_perc" in total:
            total["kv_cache_usage_perc"] /= len(per_engine)
        return total | {"engines": per_engine}

    def refresh_metrics(self) -> None:
        """Reads every core's metrics now (an idle front end steps no core: its copy would
        go stale while other front ends' requests run)."""
        for core, metrics in zip(self.cores, self.call_utility("get_metrics"), strict=True):
            core.metrics = metrics

    def call_utility(self, method: str, *args: Any) -> list[Any]:
        """vLLM's `call_utility`, on every core in turn; their results in DP-rank order."""
        call = m.UtilityCall(method, list(args))
        results = []
        for core in self.cores:
            reply = self._call(core, call, m.UtilityReply)
            if reply.error is not None:
                raise _ERRORS.get(reply.error_type or "", RuntimeError)(reply.error)
            results.append(reply.result)
        return results

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return all(self.call_utility("add_lora", msgspec.to_builtins(lora_request)))

    def remove_lora(self, lora_int_id: int) -> bool:
        return all(self.call_utility("remove_lora", lora_int_id))

    def list_loras(self) -> set[int]:
        return set(self.call_utility("list_loras")[0])

    def reset_prefix_cache(self) -> bool:
        return all(self.call_utility("reset_prefix_cache"))

    def close(self) -> None:
        if getattr(self, "_loads", None) is not None:
            self._loads.close()
        for core in self.cores:
            if core.watch is not None:
                core.watch.close()
            core.socket.close()
        self._context.term()

    # -- the sockets --

    def _first_info(self, core: _Core) -> m.EngineCoreInfo:
        """The info a core sends once it connected. A core on another host said it was
        ready before this front end started: one that has not sent it within
        `handshake_timeout()` seconds counts as dead; its watch follows the connection
        it came on."""
        from jvllm.engine.core.hosts import handshake_timeout

        if core.watch is None:
            return self._receive(core, m.EngineCoreInfo)
        timeout = handshake_timeout()
        deadline = time.monotonic() + timeout
        while True:
            while not core.socket.poll(POLL_MS):
                if time.monotonic() > deadline:
                    raise EngineCoreDeadError(
                        f"{core.name} did not connect to {core.address} within {timeout:g} s "
                        "(JVLLM_DP_HANDSHAKE_TIMEOUT_S); the server cannot serve requests"
                    )
            frame = core.socket.recv(copy=False)
            try:
                info = msgspec.msgpack.decode(frame.bytes, type=m.EngineCoreInfo)
            except msgspec.DecodeError as e:  # another program on the port: not followed
                logger.warning("ignoring a message on %s that is not a core's: %s", core.address, e)
                continue
            core.watch.follow(frame)  # the core's connection, from now on
            core.socket.accept()  # and its only peer
            return info

    def _call(self, core: _Core, message: msgspec.Struct, reply: type) -> Any:
        with self._lock:
            core.socket.send(m.encode(message))
            return self._receive(core, reply)

    def _receive(self, core: _Core, reply: type) -> Any:
        while not core.socket.poll(POLL_MS):
            exit_status = core.exit_status()
            if exit_status is not None:
                raise EngineCoreDeadError(
                    f"{core.name} died ({exit_status}); the server cannot serve requests"
                )
        return msgspec.msgpack.decode(core.socket.recv(), type=reply)


def queued_requests(params: SamplingParams | BeamSearchParams) -> int:
    """The requests a core's scheduler queues for a request: its n choices; one for a
    beam search, whose beams fork at its first selection (`admission.is_unforked_beam`)."""
    return 1 if isinstance(params, BeamSearchParams) else params.n


def process_exit_status(pid: int) -> str | None:
    """None while process `pid` runs; else how it ended, as far as /proc tells (a child
    not yet reaped is a zombie: dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "exited"
    return "exited" if state in ("Z", "X") else None


def _check_alike(infos: list[m.EngineCoreInfo]) -> None:
    """Every DP rank must serve the same model (a headless host started with other flags)."""
    first = infos[0]
    for info in infos[1:]:
        for key in ("max_model_len", "vocab_size", "eos_token_ids"):
            if getattr(info, key) != getattr(first, key):
                raise ValueError(
                    f"engine core {info.engine_index} has {key}={getattr(info, key)}, engine "
                    f"core {first.engine_index} {getattr(first, key)}: every DP rank must be "
                    "started with the same model and flags"
                )


def _bind(context: Any, index: int, pid: int, address: str) -> _Core:
    """Core `index`'s socket, bound at `address` for the core to connect to (as vLLM's
    front end); a TCP one (a core on another host) with heartbeats and a watch."""
    import zmq

    remote = address.startswith("tcp://")  # a core on another host (`hosts.py`)
    socket = context.socket(zmq.ROUTER if remote else zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    watch = None
    if remote:
        from jvllm.engine.core.connection import ConnectionWatch, PeerSocket, with_heartbeat

        watch = ConnectionWatch(with_heartbeat(socket), bound=True)
    try:
        socket.bind(address)
    except zmq.ZMQError as e:
        if watch is not None:
            watch.close()
        socket.close()
        raise ValueError(
            f"cannot listen for engine core {index} on {address} ({e}): the head's ports "
            "from --data-parallel-rpc-port up must be free on --data-parallel-address"
        ) from None
    if remote:  # talks with the core only, not other connections to its port
        socket = PeerSocket(socket)
    return _Core(index, pid, socket, watch=watch, address=address)


def _tokenize(
    tokenizer: Any, prompt: str | list[int] | dict[str, Any]
) -> tuple[str | None, list[int]]:
    """`LLMEngine`'s prompt forms: text, token ids, or a dict of either."""
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data"):
            raise InvalidRequestError(
                "images were sent, but this model takes text only (vision-language models "
                "are served in-process)",
                "multi_modal_data",
            )
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" not in prompt:
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, list(tokenizer.encode(prompt)) if prompt else []
    if isinstance(prompt, list | tuple):
        return None, [int(t) for t in prompt]
    raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt)}")


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, list) and isinstance(b, list):
        longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
        return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a + b
    return a

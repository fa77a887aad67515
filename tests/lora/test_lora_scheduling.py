"""The host side of LoRA: admission keeps at most `max_loras` adapters running, and the
prefix cache never shares blocks between adapters (`Scheduler`, `KVCacheManager`)."""

from __future__ import annotations

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.scheduling.scheduler import Scheduler
from jvllm.lora.request import LoRARequest
from jvllm.sampling_params import SamplingParams

BS = 8


def _scheduler(max_loras: int) -> Scheduler:
    config = SchedulerConfig(8, 64, 64, max_loras=max_loras)
    return Scheduler(config, CacheConfig(block_size=BS), 64)


def _add(scheduler: Scheduler, request_id: str, lora_int_id: int, prompt: list[int]) -> Request:
    lora = LoRARequest(f"a{lora_int_id}", lora_int_id, "/adapters") if lora_int_id else None
    request = Request(request_id, prompt, SamplingParams(), lora_request=lora)
    scheduler.add_request(request)
    return request


def test_a_third_adapter_waits_while_two_run_and_does_not_hold_up_others():
    scheduler = _scheduler(max_loras=2)
    _add(scheduler, "x1", 1, [5] * 4)
    _add(scheduler, "y2", 2, [6] * 4)
    third = _add(scheduler, "z3", 3, [7] * 4)
    _add(scheduler, "base", 0, [8] * 4)
    _add(scheduler, "x1-again", 1, [9] * 4)
    out = scheduler.schedule()
    assert [r.request_id for r in out.scheduled] == ["x1", "y2", "base", "x1-again"]
    assert third.status is RequestStatus.WAITING
    scheduler.update_from_output(out, [1] * len(out.scheduled))
    scheduler.finish_request("y2", RequestStatus.FINISHED_STOPPED)
    out = scheduler.schedule()
    assert "z3" in {r.request_id for r in out.scheduled}


def test_prefix_cache_blocks_are_kept_apart_by_adapter():
    scheduler = _scheduler(max_loras=3)
    prompt = list(range(10, 10 + 3 * BS))
    first = _add(scheduler, "first", 1, prompt)
    out = scheduler.schedule()
    scheduler.update_from_output(out, [1])
    kv = scheduler.kv_cache_manager
    assert kv.find_cached_prefix(_request(2, prompt)).num_tokens == 0
    assert kv.find_cached_prefix(_request(0, prompt)).num_tokens == 0
    assert kv.find_cached_prefix(_request(1, prompt)).num_tokens == 2 * BS
    assert first.num_computed_tokens == len(prompt)


def _request(lora_int_id: int, prompt: list[int]) -> Request:
    lora = LoRARequest("a", lora_int_id, "/adapters") if lora_int_id else None
    return Request(f"probe{lora_int_id}", prompt, SamplingParams(), lora_request=lora)

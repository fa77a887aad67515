"""First prompt chunks cut to end a step at the top of a token bucket."""

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.request import Request
from jvllm.engine.scheduling.scheduler import Scheduler
from jvllm.sampling_params import SamplingParams

BUCKETS = (4, 8, 16, 32, 64, 128, 160, 192, 224, 256)


def _scheduler(buckets: tuple[int, ...] | None) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512),
        CacheConfig(block_size=16, enable_prefix_caching=False),
        num_blocks=128,
    )
    scheduler.token_buckets = buckets
    return scheduler


def _tokens(scheduler: Scheduler) -> dict[str, int]:
    """One synchronous step: request id -> tokens scheduled for it."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, [7] * len(output.scheduled))
    return {row.request_id: len(row.token_ids) for row in output.scheduled}


def _decoding(scheduler: Scheduler, count: int) -> None:
    for i in range(count):
        scheduler.add_request(Request(f"d{i}", [1, 2, 3], SamplingParams(max_tokens=50)))
    assert _tokens(scheduler) == {f"d{i}": 3 for i in range(count)}


def test_a_prompt_beside_decode_rows_is_cut_to_the_bucket_below():
    scheduler = _scheduler(BUCKETS)
    _decoding(scheduler, 3)
    scheduler.add_request(Request("p", list(range(10, 138)), SamplingParams(max_tokens=4)))
    # 3 + 128 = 131 would be padded to 160: 125 now (128 in all), the last 3 next step.
    assert _tokens(scheduler) == {"d0": 1, "d1": 1, "d2": 1, "p": 125}
    assert _tokens(scheduler) == {"d0": 1, "d1": 1, "d2": 1, "p": 3}
    assert _tokens(scheduler) == {"d0": 1, "d1": 1, "d2": 1, "p": 1}  # p decodes


def test_short_steps_are_not_cut():
    scheduler = _scheduler(BUCKETS)
    _decoding(scheduler, 3)
    # 3 + 40 = 43 pads to 64; the bucket below (32) is under MIN_ALIGNED_TOKENS: whole.
    scheduler.add_request(Request("p", list(range(10, 50)), SamplingParams(max_tokens=4)))
    assert _tokens(scheduler)["p"] == 40


def test_no_cut_when_it_would_leave_more_tokens_than_the_padding():
    scheduler = _scheduler(BUCKETS)
    _decoding(scheduler, 3)
    # 3 + 150 = 153 pads 7 to 160; cutting to 128 would leave 25 for later: not cut.
    scheduler.add_request(Request("p", list(range(10, 160)), SamplingParams(max_tokens=4)))
    assert _tokens(scheduler)["p"] == 150


def test_without_buckets_or_alone_the_prompt_runs_whole():
    scheduler = _scheduler(None)
    _decoding(scheduler, 3)
    scheduler.add_request(Request("p", list(range(10, 138)), SamplingParams(max_tokens=4)))
    assert _tokens(scheduler)["p"] == 128
    # Alone, 130 tokens: the bucket below (128) leaves 2 against a padding of 30: cut.
    alone = _scheduler(BUCKETS)
    alone.add_request(Request("p", list(range(10, 140)), SamplingParams(max_tokens=4)))
    assert _tokens(alone) == {"p": 128}
    assert _tokens(alone) == {"p": 2}


def test_after_a_cut_the_step_admits_no_more_prompts():
    scheduler = _scheduler(BUCKETS)
    _decoding(scheduler, 3)
    scheduler.add_request(Request("p", list(range(10, 138)), SamplingParams(max_tokens=4)))
    scheduler.add_request(Request("q", list(range(10, 30)), SamplingParams(max_tokens=4)))
    # q beside the cut p would pad the step past 128 again: it waits for the next step.
    assert _tokens(scheduler) == {"d0": 1, "d1": 1, "d2": 1, "p": 125}
    assert _tokens(scheduler) == {"d0": 1, "d1": 1, "d2": 1, "p": 3, "q": 20}

"""The front end's view of a core's load (`engine/core/client.py`'s `_Core.load`, vLLM's
waiting * 4 + running): counted in sequences throughout, as the cores' schedulers and the
DP coordinator's table count them, so that a front end's own adds not yet in the table
weigh what they will weigh once there."""

from __future__ import annotations

from jvllm.engine.core import messages as m
from jvllm.engine.core.client import _Core


def test_unseen_adds_weigh_their_sequences_as_the_table_will():
    """A request with 4 choices (taken as the core's 3rd) weighs 4 waiting sequences
    before the coordinator's table shows it and the same once it does."""
    core = _Core(0, 1, None, shared=m.EngineLoad(0, waiting=1, running=2, num_added=2))
    core.own_adds = [(3, 4)]
    before = core.load()
    core.shared = m.EngineLoad(0, waiting=1 + 4, running=2, num_added=3)
    assert before == core.load() == (1 + 4) * 4 + 2


def test_a_beam_search_weighs_what_the_cores_scheduler_queues_for_it():
    """A beam search of width 4 waits in the core's scheduler as one request until its
    first selection forks it: an add weighs that, not its width."""
    from jvllm.config import CacheConfig, SchedulerConfig
    from jvllm.engine.beam_search import BeamGroup
    from jvllm.engine.core.client import queued_requests
    from jvllm.engine.scheduling.scheduler import Scheduler
    from jvllm.sampling_params import BeamSearchParams, SamplingParams

    scheduler = Scheduler(SchedulerConfig(8, 64, 64, "continuous"), CacheConfig(block_size=16), 64)
    params = BeamSearchParams(beam_width=4, max_tokens=3)
    group = BeamGroup("b", None, [1, 2, 3], params, frozenset({0}), 64, 0.0)
    for beam in group.beams:
        scheduler.add_request(beam.request)
    assert queued_requests(params) == len(scheduler.waiting) == 1
    assert queued_requests(SamplingParams(n=3)) == 3
    core = _Core(0, 1, None, metrics={"num_requests_waiting": 2, "num_requests_running": 1})
    core.added = queued_requests(params)
    before = core.load()
    core.metrics, core.added = {"num_requests_waiting": 3, "num_requests_running": 1}, 0
    assert before == core.load() == 3 * 4 + 1

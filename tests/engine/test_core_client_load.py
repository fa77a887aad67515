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

"""The collector's settings while serving (jvllm.engine.gc_heap)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from jvllm.engine.gc_heap import SERVING_GEN0_THRESHOLD, serving_gc


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def _restore_collector():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_serving_gc_freezes_what_lives_and_restores_the_collector() -> None:
    gc.set_threshold(700, 10, 10)
    node = Node()
    ref = weakref.ref(node)
    with serving_gc():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (SERVING_GEN0_THRESHOLD, 10, 10)
        del node
        gc.collect()
        assert ref() is not None  # frozen: no collection looks at it
        fresh = Node()
        fresh_ref = weakref.ref(fresh)
        del fresh
        gc.collect()
        assert fresh_ref() is None  # allocated inside: collected as usual
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == (700, 10, 10)
    gc.collect()
    assert ref() is None  # thawed, so collected


def test_serving_gc_leaves_a_heap_frozen_by_someone_else_frozen() -> None:
    node = Node()
    ref = weakref.ref(node)
    gc.freeze()
    del node
    with serving_gc():
        assert gc.get_freeze_count() > 0
    gc.collect()
    assert ref() is not None  # still frozen: the block thawed nothing it did not freeze
    gc.unfreeze()
    gc.collect()
    assert ref() is None


def test_a_higher_threshold_is_kept() -> None:
    gc.set_threshold(50_000, 20, 20)
    with serving_gc():
        assert gc.get_threshold() == (50_000, 20, 20)
    assert gc.get_threshold() == (50_000, 20, 20)


def test_freeze_gc_heap_lasts_for_the_process() -> None:
    code = (
        "import gc; from jvllm.engine.gc_heap import freeze_gc_heap; freeze_gc_heap(); "
        "print(gc.get_freeze_count() > 0, gc.get_threshold()[0])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", str(SERVING_GEN0_THRESHOLD)]

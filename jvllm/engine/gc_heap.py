"""Python's cyclic garbage collector while the engine serves.

A decode step allocates a few container objects per running request (rows, sampling
rows, outputs) and frees nearly all of them by reference counting within the step. With
CPython's default gen-0 threshold (700 net allocations) a decode step at 1024 running
requests still triggers about eleven collections, one of them gen-1, and one step in
twenty a full collection, which scans every object alive: a few hundred thousand once
JAX and Transformers are imported, about 0.2 s each here (`bench/host_overhead.py`:
10-11 ms of collections a step on average at 1024 requests, 0.2 ms at 256). As vLLM
does after start-up (its `freeze_gc_heap`), the objects alive when serving begins are
frozen: left out of every collection. And the gen-0 threshold is raised, so that the
per-step churn no longer triggers collections at all.

`jvllm serve` does both for good once the server is built (the process serves and
nothing else); `LLM`'s generation loops do them for their duration (`serving_gc`) and
restore the collector as they found it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# Net allocations of tracked objects between gen-0 collections while serving (CPython's
# default: 700). A step's churn is freed within the step, so this bounds how much
# cyclic garbage waits, not how much memory the engine uses.
SERVING_GEN0_THRESHOLD = 10_000


def freeze_gc_heap() -> None:
    """Collect, then freeze every object alive (for the rest of the process), and raise
    the gen-0 threshold to SERVING_GEN0_THRESHOLD."""
    gc.collect()
    gc.freeze()
    _raise_gen0_threshold()


@contextlib.contextmanager
def serving_gc() -> Iterator[None]:
    """While the block runs: the objects alive at its start frozen (unless something else
    froze the heap already: that freeze stays as it is), the gen-0 threshold raised.
    Afterwards the thresholds are restored and what this froze is thawed, so cyclic
    garbage among those objects is collected as before."""
    thresholds = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    _raise_gen0_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()


def _raise_gen0_threshold() -> None:
    first, *rest = gc.get_threshold()
    gc.set_threshold(max(first, SERVING_GEN0_THRESHOLD), *rest)

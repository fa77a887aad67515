"""StepRows: steady decode rows kept as columns read the same as whole rows."""

import numpy as np

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.request import Request
from jvllm.engine.scheduling.scheduler import Scheduler
from jvllm.engine.step_io import PLACEHOLDER_TOKEN, RowColumns, SchedulerOutput, StepRows
from jvllm.sampling_params import SamplingParams

BS = 8


def _overlapped_steps(num_steps: int) -> list[SchedulerOutput]:
    """Schedules as the engine does with async scheduling (step N + 1 before committing
    step N), with chunked prompts beside decode rows and one request stopping at its
    length limit."""
    scheduler = Scheduler(SchedulerConfig(8, 24, 64), CacheConfig(block_size=BS), 64)
    for i, length in enumerate([5, 30, 12, 9]):
        prompt = [(7 * i + j) % 50 + 1 for j in range(length)]
        max_tokens = 6 if i == 2 else 30
        scheduler.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens)))
    outputs, pending = [], None
    for step in range(num_steps):
        out = scheduler.schedule()
        outputs.append(out)
        if pending is not None:
            scheduler.update_from_output(pending, [100 + step] * len(pending.scheduled))
        pending = out
    return outputs


def test_steady_rows_read_as_whole_rows_and_feed_back_the_previous_row():
    outputs = _overlapped_steps(14)
    num_steady = 0
    for before, out in zip(outputs, outputs[1:], strict=False):
        rows = out.scheduled
        assert isinstance(rows, StepRows)
        whole = list(rows)  # every row made whole
        assert rows == whole and len(rows) == len(whole)
        expected = RowColumns.of(whole)
        for name, column in zip(RowColumns._fields, out.columns, strict=True):
            np.testing.assert_array_equal(column, getattr(expected, name), err_msg=name)
        for i, row in enumerate(whole):
            assert row.request_id == rows.requests[i].request_id
            if i in rows.whole:
                continue
            num_steady += 1
            assert row.token_ids == [PLACEHOLDER_TOKEN] and row.samples
            assert row.num_spec_tokens == 0 and row.block_table
            # Its token is the one its request's row of the step before samples.
            assert before.scheduled[row.prev_step_row].request_id == row.request_id
    assert num_steady > 10  # most rows were steady ones


def test_a_slice_and_negative_index_make_rows_whole():
    rows = _overlapped_steps(8)[-1].scheduled
    assert rows[-1] == rows[len(rows) - 1]
    assert rows[1:3] == [rows[1], rows[2]]
    assert rows != [] and StepRows({}) == []

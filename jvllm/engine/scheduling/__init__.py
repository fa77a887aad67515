"""Scheduling: which requests run in the next step, and how many tokens each.

`scheduler` (the protocol: `schedule()`, `update_from_output()`, `finish_request()`,
and the running requests' rows), `admission` (waiting and swapped requests joining,
preemption). Block accounting is `jvllm.engine.kv`'s; stop checks and outputs are the
output processor's.
"""

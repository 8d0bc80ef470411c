"""Stage 3, the cost models: what a schedule costs in memory and in time.

``_memory`` (liveness walk: device and host peaks), ``_xla_buffers`` (which
values get a buffer, learned from the target compiler's own program), ``_hlo``
(the optimized-HLO reader), ``_perf`` (the performance model over a schedule),
``_xla_clock`` (a compiled program's time on a target) and ``_evaluate`` (a
plan evaluated: schedule, memory and time together, the one call planners
make). Internal: nothing here is public API.
"""

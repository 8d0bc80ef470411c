"""Stage 2, the schedule: a plan applied to the graph's equations, and the
function that runs it.

``_order`` (where updates and a block's recomputation go), ``_schedule``
(the builder: recomputation under barriers, copies to host and back,
vTensor split/merge), ``_scan_remat``, ``_loop_segments`` and
``_loop_schedule`` (the same inside loops) and ``_emit`` (schedule -> a
function for ``jax.jit``). Internal: nothing here is public API.
"""

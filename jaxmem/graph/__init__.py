"""Stage 1, the graph: a training step's joint jaxpr read as a :class:`Graph`.

``_graph`` (equations, values, residuals, layers), ``_primitives`` (what each
primitive is to jaxmem), ``_loops`` (forward scans and the backward scans that
read their stacks) and ``_xla_cpu_fusion`` (which values XLA:CPU gives no
buffer, a property of the graph that the schedule builder and the memory
model both read). Internal: nothing here is public API.
"""

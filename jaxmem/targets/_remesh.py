"""A step's meshes moved onto a compile-only target's GPUs.

A step written with ``jax.shard_map`` (or with sharding constraints on a
``Mesh``) names the mesh of the devices it runs on, in its jaxpr. To
compile it for GPUs that are not here, every such mesh is replaced by a mesh
of as many compile-only GPUs of the target's kind, of the same shape and
axis names (``Target.mesh_like``): the program XLA:GPU partitions for them
is the one the step would run there. The step keeps running here on its own
mesh; only what is compiled for the target is moved.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  >>> step = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
  ...                      in_specs=P("data"), out_specs=P())
  >>> one = Mesh(np.array(jax.devices()[:1]), ("data",))  # stands for a target's
  >>> closed = moved(jax.make_jaxpr(step)(jnp.ones(4)), lambda m: one)
  >>> closed.eqns[0].params["mesh"] is one
  True
  >>> moved(jax.make_jaxpr(jnp.sin)(jnp.ones(4)), lambda m: one) is None  # no mesh
  True
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import AbstractMesh, Mesh, NamedSharding


@functools.lru_cache(maxsize=None)
def _devices_here() -> frozenset:
  """This process's devices (fixed once its backends start)."""
  return frozenset(jax.devices()) | frozenset(jax.devices("cpu"))


def _local(mesh) -> bool:
  return isinstance(mesh, Mesh) and not set(mesh.devices.flat).isdisjoint(_devices_here())


def _params_values(jaxpr: jex.Jaxpr):
  """Every parameter value of ``jaxpr``'s equations, nested jaxprs' too."""
  for eqn in jaxpr.eqns:
    for value in eqn.params.values():
      for item in value if isinstance(value, tuple) else (value,):
        if isinstance(item, jex.ClosedJaxpr):
          yield from _params_values(item.jaxpr)
        elif isinstance(item, jex.Jaxpr):
          yield from _params_values(item)
        else:
          yield item


class _Moved:
  """The rule that moves one jaxpr's meshes: each mesh of this machine's
  devices to ``mesh_like(mesh)``, each abstract mesh of the same axes to
  the moved mesh's, with its own axis types (inside a ``shard_map`` some
  axes are manual)."""

  def __init__(self, mesh_like: Callable[[Mesh], Mesh], jaxpr: jex.Jaxpr):
    self.mesh_like = mesh_like
    # (axis names, sizes) -> the target's abstract mesh, for each mesh of
    # this machine's devices the jaxpr names (none: nothing to move).
    self.abstract: dict = {}
    self.vars: dict = {}  # a variable -> the same with its aval's mesh moved
    for value in _params_values(jaxpr):  # every mesh known before any is moved
      self.value(value)

  def mesh(self, mesh):
    if _local(mesh):
      moved = self.mesh_like(mesh)
      self.abstract[(mesh.axis_names, mesh.axis_sizes)] = moved.abstract_mesh
      return moved
    if isinstance(mesh, AbstractMesh):
      found = self.abstract.get((mesh.axis_names, mesh.axis_sizes))
      return mesh if found is None else found.update(axis_types=mesh.axis_types)
    return mesh

  def value(self, value):
    if isinstance(value, NamedSharding):
      return NamedSharding(self.mesh(value.mesh), value.spec, memory_kind=value.memory_kind)
    if isinstance(value, (Mesh, AbstractMesh)):
      return self.mesh(value)
    if isinstance(value, jex.ClosedJaxpr):
      return jex.ClosedJaxpr(self.jaxpr(value.jaxpr), value.consts)
    if isinstance(value, jex.Jaxpr):
      return self.jaxpr(value)
    if isinstance(value, tuple):
      return tuple(self.value(v) for v in value)
    return value

  def aval(self, aval):
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      return aval
    return aval.update(sharding=self.value(sharding))

  def atom(self, atom):
    """``atom`` with its aval's mesh moved (what a nested jaxpr's variables
    say is what its equation's abstract evaluation gives); a literal's
    value too where it carries an aval (JAX's typed host arrays)."""
    if isinstance(atom, jex.Literal):
      return jex.Literal(self.literal(atom.val), self.aval(atom.aval))
    if atom not in self.vars:
      aval = self.aval(atom.aval)
      self.vars[atom] = atom if aval is atom.aval else type(atom)(aval)
    return self.vars[atom]

  def literal(self, val):
    """A literal's value with the aval it carries moved, its type and weak
    type kept (a plain NumPy array where its type takes no aval)."""
    carried = getattr(val, "aval", None)
    if not isinstance(val, np.ndarray) or carried is None or self.aval(carried) is carried:
      return val
    try:
      return type(val)(np.asarray(val), self.aval(carried))
    except TypeError:
      return np.asarray(val)

  def context(self, ctx):
    """An equation's context under the moved abstract mesh (the one its
    tracing ran under), or ``ctx`` where it names none."""
    mesh = getattr(ctx, "cur_abstract_mesh", None)
    moved = self.mesh(mesh) if mesh is not None else None
    if moved is None or moved is mesh:
      return ctx
    with ctx.manager, jax.sharding.use_abstract_mesh(moved):
      return type(ctx)()

  def jaxpr(self, jaxpr: jex.Jaxpr) -> jex.Jaxpr:
    atoms = lambda vs: [self.atom(v) for v in vs]  # noqa: E731
    eqns = [eqn.replace(invars=atoms(eqn.invars), outvars=atoms(eqn.outvars),
                        params={k: self.value(v) for k, v in eqn.params.items()},
                        ctx=self.context(eqn.ctx)) for eqn in jaxpr.eqns]
    return jaxpr.replace(constvars=atoms(jaxpr.constvars), invars=atoms(jaxpr.invars),
                         outvars=atoms(jaxpr.outvars), eqns=eqns)


def moved(closed: jex.ClosedJaxpr,
          mesh_like: Callable[[Mesh], Mesh]) -> jex.ClosedJaxpr | None:
  """``closed`` with each mesh of this machine's devices (a ``shard_map``'s,
  or a sharding constraint's) replaced by ``mesh_like(mesh)``
  (:meth:`~jaxmem.targets.Target.mesh_like`); None where it names none."""
  mover = _Moved(mesh_like, closed.jaxpr)
  if not mover.abstract:
    return None
  return jex.ClosedJaxpr(mover.jaxpr(closed.jaxpr), closed.consts)


def retargeted(fun: Callable, leaves: Sequence, mesh_like: Callable[[Mesh], Mesh]) -> Callable:
  """``fun`` (over flat leaves, returning a list) as compiled for a target
  whose meshes ``mesh_like`` gives: traced once at ``leaves``' shapes and,
  where it names a mesh of this machine's devices, evaluated with the
  moved jaxpr; else ``fun`` itself."""
  avals = [jax.ShapeDtypeStruct(np.shape(x), jax.typeof(x).dtype,
                                weak_type=jax.typeof(x).weak_type) for x in leaves]
  closed = moved(jax.make_jaxpr(fun)(*avals), mesh_like)
  return fun if closed is None else jex.jaxpr_as_fun(closed)

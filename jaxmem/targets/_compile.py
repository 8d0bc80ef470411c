"""Where a step is compiled to be measured, and how its footprint is read.

A :class:`Target` is the GPU (or CPU) a fit plans for: the profile plans are
timed on, and the device its compilations are made for. A target named by a
profile (``transform(..., target="t4")``) compiles on a *compile-only*
device made from the profile's :class:`~jaxmem.targets.GpuDescription`
(``jax.experimental.topologies``): XLA:GPU's own program for that GPU,
compiled on whatever machine jaxmem runs on, with the footprint
``memory_analysis()`` gives, host memory included. Arguments placed on such
a device by the user (``jax.ShapeDtypeStruct`` with a sharding on a
topology's mesh) make their device the target. Otherwise the target is
where the arguments live: the GPU present, or the CPU.

Compile-only devices need JAX's CUDA plugin, not a GPU or CUDA's libraries:
``pip install "jax[cuda13-local]"`` (about 130 MB).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from typing import Callable, Sequence

import jax

from jaxmem import _flags
from jaxmem.targets._remesh import retargeted
from jaxmem.targets._profiles import PROFILES, DeviceProfile, get_profile, profile_for_kind

# Bytes the GPU runtime allocates beyond XLA's compiled footprint (cuDNN and
# cuBLAS workspaces, allocator rounding). Measured on an H200 with JAX 0.11.2:
# 0.01-0.04 GiB on unmodified zoo steps, up to 92 MB on a ResNet-18 plan.
# XLA:CPU's footprint is what the process allocates.
GPU_RUNTIME_RESERVE = 128 * 2**20

PLUGIN_HINT = ('install JAX\'s CUDA plugin, which compiles for GPUs without one: '
               'pip install "jax[cuda13-local]" (or jaxmem\'s extra: pip install '
               '"jaxmem[target]")')


def runtime_reserve(platform: str) -> int:
  """Bytes kept free under an absolute budget for what the runtime allocates
  outside XLA's footprint on ``platform`` (none on CPU).

  Example:
    >>> runtime_reserve("cpu"), runtime_reserve("gpu") // 2**20
    (0, 128)
  """
  return 0 if platform == "cpu" else GPU_RUNTIME_RESERVE


def xla_footprint(compiled) -> int | None:
  """Device bytes of a compiled step: temp + arguments + outputs - aliases.

  ``memory_analysis()``'s ``peak_memory_in_bytes`` leaves temporaries out on
  CPU, so the footprint is summed from its parts. Returns None where the
  backend gives no analysis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> c = jax.jit(lambda x: x * 2).lower(jnp.ones(256)).compile()
    >>> xla_footprint(c)
    2048
  """
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes
             + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def host_bytes(compiled) -> int:
  """Bytes a compiled program keeps in host memory (temporaries, arguments
  and outputs in ``pinned_host``); 0 where the backend ignores host memory."""
  stats = compiled.memory_analysis()
  if stats is None:
    return 0
  return int(stats.host_temp_size_in_bytes + stats.host_output_size_in_bytes
             + stats.host_argument_size_in_bytes)


_WORKSPACE = re.compile(r"\b[su]8\[(\d+)\]")


def workspace_bytes(compiled) -> int:
  """The largest scratch buffer a library call of the compiled program
  takes (the ``s8``/``u8`` workspace XLA:GPU gives cuBLAS and cuDNN calls:
  4 MiB per GEMM for a T4). It is part of XLA's footprint whatever a plan
  does, and the memory model, which counts the step's own values, does not
  hold it; on a small step it is most of the footprint. 0 on XLA:CPU.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> workspace_bytes(jax.jit(jnp.dot).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile())
    0
  """
  sizes = [int(size) for line in compiled.as_text().splitlines() if "custom-call(" in line
           for size in _WORKSPACE.findall(line.split("custom-call(", 1)[0])]
  return max(sizes, default=0)


def holds_host_memory(compiled) -> bool:
  """Whether a compiled program puts anything in host memory."""
  return host_bytes(compiled) > 0


@functools.lru_cache(maxsize=None)
def _topology(description_text: str, count: int):
  """A compile-only host of ``count`` GPUs made from their description."""
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc(
        platform="cuda", target_config=description_text, topology=f"1x1x{count}")
  except Exception as err:  # the plugin raises several types
    raise RuntimeError(
        f"jaxmem: cannot make a compile-only GPU device ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}); to plan for a GPU "
        f"target, {PLUGIN_HINT}.") from err


@functools.lru_cache(maxsize=None)
def _compile_only_sharding(description_text: str) -> jax.sharding.NamedSharding:
  """A sharding on one compile-only GPU made from its description."""
  mesh = _compile_only_mesh(description_text, (1,), ("x",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@functools.lru_cache(maxsize=None)
def _compile_only_mesh(description_text: str, shape: tuple[int, ...],
                       names: tuple[str, ...]) -> jax.sharding.Mesh:
  """A mesh of ``shape`` over a compile-only host of that many GPUs of the
  description's kind (a topology ``1x1xN``)."""
  from jax.experimental import topologies
  return topologies.make_mesh(_topology(description_text, math.prod(shape)), shape, names)


def _compile_only(device) -> bool:
  """Whether ``device`` is a compile-only device (on no backend of this
  process)."""
  try:
    local = jax.devices(device.platform)
  except RuntimeError:
    return True
  return device not in local


def _placed_device(leaf):
  """The device an abstract argument is placed on, or None."""
  sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.ShapeDtypeStruct) else None
  devices = getattr(sharding, "device_set", None)
  return next(iter(devices)) if devices else None


@dataclasses.dataclass(frozen=True)
class Target:
  """The device a fit compiles for, and the profile its plans are timed on.

  Attributes:
    platform: the compiler's platform (``"cpu"``, ``"gpu"``, ...).
    profile: the profile plans are timed on (None: the planner's own).
    sharding: where the fit loop places abstract copies of the arguments,
      and the values it compiles to learn the target's buffers, to compile
      them (a compile-only device); None: the arguments as given, the
      values on the default backend.
    name: how reports name it (``"t4 (XLA:GPU, compile-only)"``).
    compile_only: whether its device is a compile-only one (a GPU that is
      not here).
  """
  platform: str
  profile: DeviceProfile | None = None
  sharding: jax.sharding.Sharding | None = None
  name: str = ""
  compile_only: bool = False

  def place(self, leaves: Sequence) -> list:
    """The argument leaves as the fit loop compiles them: abstract, on the
    compile-only device, where there is one (a leaf sharded over a mesh of
    several devices: over a mesh of as many compile-only GPUs, of the same
    shape and axis names, with the same spec); else as given."""
    if self.sharding is None:
      return list(leaves)
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._on_target(x),
                                 weak_type=a.weak_type)
            for x, a in zip(leaves, [jax.typeof(x) for x in leaves])]

  def _on_target(self, leaf) -> jax.sharding.Sharding:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.size < 2:
      return self.sharding
    if all(map(_compile_only, sharding.device_set)):
      return sharding  # on a mesh of compile-only GPUs already
    return jax.sharding.NamedSharding(self.mesh_like(sharding.mesh), sharding.spec)

  def mesh_like(self, mesh: jax.sharding.Mesh,
                shape: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
    """The mesh of the target's GPUs that stands for ``mesh`` (of this
    machine's devices) in what is compiled for it: on a compile-only
    target, as many compile-only GPUs in the same shape (or ``shape``),
    with the same axis names; else ``mesh`` itself."""
    if not self.compile_only:
      return mesh
    if self.profile is None or self.profile.description is None:
      raise ValueError(
          f"jaxmem: target {self.name} has no GPU description to make a mesh of its "
          f"GPUs from (profile {self.profile and self.profile.name!r}); pass target= a "
          "profile with one (a name in jaxmem.PROFILES, or jaxmem.calibrate()'s).")
    return _compile_only_mesh(self.profile.description.text(), shape or mesh.devices.shape,
                              tuple(mesh.axis_names))

  def compiles(self, fun: Callable, leaves: Sequence, one_device: bool = False) -> Callable:
    """``fun`` (over flat leaves ``leaves``) as compiled for this target:
    on a compile-only target, with the meshes it names of this machine's
    devices moved onto the target's GPUs (``_remesh``), or with
    ``one_device``, onto the one GPU its arguments are placed on (each mesh
    axis of size 1: every shard whole); else ``fun``."""
    if not self.compile_only:
      return fun
    if not one_device:
      return retargeted(fun, leaves, self.mesh_like)
    return retargeted(fun, leaves, lambda mesh: self.mesh_like(mesh, (1,) * mesh.devices.ndim))

  def options(self, measuring: bool = False) -> dict:
    """Compiler options for this target's compilations (see ``_flags``).
    A compile-only GPU cannot autotune, and XLA:GPU's untuned Triton GEMM
    fails on some shapes there ("Couldn't find output tile sizes": a ViT
    step for an H100, jax 0.10.2); its GEMMs go to cuBLAS instead, as a
    T4's always do."""
    options = (_flags.measuring_options if measuring else _flags.compiler_options)(
        self.platform)
    if self.compile_only and self.platform == "gpu":
      options = {**options, "xla_gpu_enable_triton_gemm": False}
    return options

  def reserve(self) -> int:
    return runtime_reserve(self.platform)

  @contextlib.contextmanager
  def compiling(self):
    """The context a fit's compilations run in: for a compile-only target,
    none is written to JAX's persistent compilation cache
    (``jax_compilation_cache_dir``). JAX writes a compile-only executable
    there but cannot load one back without the GPU ("PjRtCompiler must be
    constructed with a Client"): each entry would be disk spent on a
    warning at every later run's compile of the same program."""
    if not self.compile_only:
      yield
      return
    from jax._src import config  # its states are context managers (thread-local)
    with config.persistent_cache_min_compile_time_secs(math.inf):
      yield

  def may_host_state(self) -> bool:
    """Whether a fit may keep optimizer state in host memory here: on a GPU
    with a host link (not one whose memory is the host's)."""
    return self.platform == "gpu" and not (self.profile is not None and self.profile.unified)


def resolve(target, leaves: Sequence) -> Target:
  """The :class:`Target` of a fit: ``target`` as given to ``transform``
  (None, a name in ``jaxmem.PROFILES`` or a :class:`DeviceProfile` with a
  description), for arguments ``leaves``.

  Example:
    >>> import jax.numpy as jnp
    >>> resolve(None, [jnp.ones(2)]).platform
    'cpu'
  """
  if target is not None:
    return _profile_target(get_profile(target))
  for leaf in leaves:
    device = _placed_device(leaf)
    if device is not None and _compile_only(device):
      return Target(device.platform, profile_for_kind(device.device_kind),
                    jax.sharding.SingleDeviceSharding(device),
                    f"{device.device_kind} (compile-only device of the arguments)",
                    compile_only=True)
  platform = platform_of(leaves)
  profile = None
  if platform != "cpu":
    device = jax.devices(platform)[0]
    profile = profile_for_kind(device.device_kind)
  return Target(platform, profile, None, platform if profile is None else
                f"{profile.name} ({platform}, this machine)")


@functools.lru_cache(maxsize=None)
def _profile_target(profile: DeviceProfile) -> Target:
  """The compile-only target of a profile (resolved once per profile: every
  call of a fitted step resolves its target)."""
  if profile.description is None:
    raise ValueError(
        f"jaxmem: target {profile.name!r} has no GPU description to compile for "
        "(DeviceProfile.description is None); pass a profile with one "
        f"(jaxmem.PROFILES: {sorted(n for n, p in PROFILES.items() if p.description)}, or "
        "jaxmem.calibrate() run on the GPU), or plan it as a planner's target "
        "instead: transform(..., planner=jaxmem.hybrid(target=profile)).")
  return Target("gpu", profile, _compile_only_sharding(profile.description.text()),
                f"{profile.name} (XLA:GPU for {profile.description.name}, compiled here)",
                compile_only=True)


def platform_of(leaves) -> str:
  """The platform the arguments live on or are placed on (the default
  backend's where none says, e.g. under an outer ``jax.jit``)."""
  for leaf in leaves:
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      return next(iter(leaf.devices())).platform
    device = _placed_device(leaf)
    if device is not None:
      return device.platform
  return jax.default_backend()


def placed(tree, target):
  """``tree``'s arrays as abstract arguments (``jax.ShapeDtypeStruct``) on
  the compile-only device of ``target`` (a name in ``jaxmem.PROFILES`` or a
  profile with a description), for ``fitted.lower(*placed(args, "t4"))``:
  planned and lowered for that GPU; ``.compile()`` gives its executable,
  which ``jax.experimental.serialize_executable`` can carry to it.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxmem.targets import placed
    >>> w = placed(jnp.ones((4, 4)), "t4")  # doctest: +SKIP
    >>> w.sharding.device_set  # doctest: +SKIP
    {Tesla T4_0(process=0,(0))}
  """
  where = resolve(target, ())
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return jax.tree_util.tree_unflatten(treedef, where.place(leaves))

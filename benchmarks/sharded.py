"""Sharded steps on 8 emulated CPU devices: per-device footprint and FLOPs,
jaxmem against the step as written and against per-block remat; with
``--target``, each compiled by XLA:GPU for 8 such GPUs (compile-only, the
same mesh shape and axis names) and timed by the clock.

Meshes (each step's budget is per device, a share of its own per-device
footprint):

* ``dp-mlp``: a residual tanh MLP under ``jax.jit``, its batch over ``data``;
* ``shard_map-mlp``: the same MLP written per device under ``shard_map``,
  its updates ``pmean``-ed over ``data``;
* ``fsdp-transformer``: the zoo's Flax transformer, parameters and Adam
  state sharded over ``data`` along their largest axis that 8 divides;
* ``dxm-transformer``: the same on a ``2 x 4`` ``data x model`` mesh, each
  kernel's output features over ``model``.

Per-block remat wraps each layer (each transformer block) in
``jax.checkpoint`` with a policy. FLOPs are XLA's cost analysis of the
per-device program, as a ratio to the step as written (none for a step in
micro-batches: the analysis counts a loop's body once). ``model / XLA`` is
the memory model's footprint of each plan over XLA's per-device footprint
of it (none in micro-batches, where the model is one micro-batch's).

    PYTHONPATH=. python benchmarks/sharded.py --out benchmarks/results/sharded-cpu8
    PYTHONPATH=. python benchmarks/sharded.py --target t4 --out benchmarks/results/sharded-t4x8
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxmem  # noqa: E402
from jaxmem._benchmark import compiled_flops  # noqa: E402
from jaxmem._zoo import models  # noqa: E402
from jaxmem.cost._xla_clock import program_time  # noqa: E402
from jaxmem.targets import get_profile, placed, xla_footprint  # noqa: E402

from benchmarks import _results  # noqa: E402
from benchmarks._steps import compile_for  # noqa: E402

MIB = 2**20
POLICIES = ("nothing_saveable", "dots_with_no_batch_dims_saveable")
BUDGETS = ("70%", "50%")


def _mlp(policy: str | None):
  """An SGD step of a 12-layer residual tanh MLP, each layer under
  ``jax.checkpoint`` with ``policy`` where given."""
  def layer(h, w):
    return h + jnp.tanh(h @ w)
  if policy:
    layer = jax.checkpoint(layer, policy=getattr(jax.checkpoint_policies, policy))

  def step(ws, batch):
    def loss(ws):
      h = batch["x"]
      for w in ws:
        h = layer(h, w)
      return jnp.mean((h - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(ws)
    return [w - 0.1 * g for w, g in zip(ws, grads)], value
  return step


def _mlp_args(mesh):
  keys = jax.random.split(jax.random.key(0), 14)
  ws = jax.device_put([jax.random.normal(k, (64, 64)) / 8 for k in keys[:12]],
                      NamedSharding(mesh, P()))
  batch = jax.device_put({n: jax.random.normal(k, (4096, 64)) for n, k in zip("xy", keys[12:])},
                         NamedSharding(mesh, P("data")))
  return ws, batch


def dp_mlp(policy):
  mesh = Mesh(np.array(jax.devices()), ("data",))
  return _mlp(policy), _mlp_args(mesh)


def shard_map_mlp(policy):
  mesh = Mesh(np.array(jax.devices()), ("data",))
  local = _mlp(policy)
  step = jax.shard_map(lambda ws, batch: jax.lax.pmean(local(ws, batch), "data"), mesh=mesh,
                       in_specs=(P(), P("data")), out_specs=(P(), P()))
  return step, _mlp_args(mesh)


def _transformer(mesh, spec, policy):
  task = models().get("transformer", depth=4, dim=64, heads=4, seq=64, batch=32, vocab=256,
                      remat=policy)
  state, batch = task.init()
  state = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), state)
  return task.step, (state, jax.device_put(batch, NamedSharding(mesh, P("data"))))


def _fsdp_spec(a):
  axes = [i for i in range(a.ndim) if a.shape[i] % 8 == 0]
  if not axes:
    return P()
  axis = max(axes, key=lambda i: a.shape[i])
  return P(*["data" if i == axis else None for i in range(a.ndim)])


def _model_spec(a):
  return P(*([None] * (a.ndim - 1)), "model") if a.ndim >= 2 and a.shape[-1] % 4 == 0 else P()


def fsdp_transformer(policy):
  return _transformer(Mesh(np.array(jax.devices()), ("data",)), _fsdp_spec, policy)


def dxm_transformer(policy):
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  return _transformer(mesh, _model_spec, policy)


MESHES = {"dp-mlp": dp_mlp, "shard_map-mlp": shard_map_mlp,
          "fsdp-transformer": fsdp_transformer, "dxm-transformer": dxm_transformer}


def _ms(compiled, target: str | None) -> float | None:
  """The clock's predicted milliseconds of ``compiled`` on ``target``."""
  return None if target is None else program_time(compiled.as_text(),
                                                  get_profile(target)).seconds * 1e3


def _ratio(flops: float | None, own: float | None) -> float | None:
  """FLOPs as a ratio to the step's (None where XLA gives no cost analysis:
  a compile-only GPU's program)."""
  return None if flops is None or not own else flops / own


def rows_for(name: str, target: str | None = None) -> list[dict]:
  make = MESHES[name]
  step, args = make(None)
  written = compile_for(step, args, target)[0]
  own, own_flops = xla_footprint(written), compiled_flops(written)
  rows = [dict(mesh=name, method="as written", footprint=own, seconds=0.0,
               flops=_ratio(own_flops, own_flops), ms=_ms(written, target))]
  for policy in POLICIES:
    remat_step, remat_args = make(policy)
    compiled = compile_for(remat_step, remat_args, target)[0]
    rows.append(dict(mesh=name, method=f"per-block remat: {policy}",
                     footprint=xla_footprint(compiled), ms=_ms(compiled, target),
                     flops=_ratio(compiled_flops(compiled), own_flops), seconds=0.0))
  for budget in BUDGETS:
    start = time.perf_counter()
    fitted = jaxmem.transform(step, budget=budget, target=target)
    try:
      fit = fitted.fit(*args)
    except jaxmem.BudgetError as err:
      rows.append(dict(mesh=name, method=f"jaxmem {budget}", footprint=None, flops=None,
                       seconds=time.perf_counter() - start,
                       smallest=err.smallest))
      continue
    compiled = fitted.lower(*(args if target is None else placed(args, target))).compile()
    footprint = xla_footprint(compiled)
    rows.append(dict(mesh=name, method=f"jaxmem {budget}", footprint=footprint,
                     model=None if fit.micro else fit.memory.peak / footprint,
                     ms=_ms(compiled, target),
                     flops=_ratio(compiled_flops(compiled), own_flops),
                     seconds=time.perf_counter() - start, budget=fit.budget,
                     micro=None if fit.micro is None else fit.micro.count))
  for row in rows:
    row["share"] = None if row["footprint"] is None else row["footprint"] / own
  return rows


def table(rows) -> str:
  timed = any(r.get("ms") is not None for r in rows)
  lines = ["| mesh | method | per-device footprint MiB (share) | FLOPs per device (ratio) | "
           + ("predicted ms | " if timed else "") + "model / XLA | fit s |",
           "|---|---|---|---|" + ("---|" if timed else "") + "---|---|"]
  for r in rows:
    if r["footprint"] is None:
      cell = f"not met; smallest {r['smallest'] / MIB:.2f} MiB"
      flops = "-"
    else:
      cell = f"{r['footprint'] / MIB:.2f} ({r['share']:.0%})"
      flops = "-" if r["flops"] is None else f"{r['flops']:.2f}x"
      if r.get("micro"):  # XLA's cost analysis counts a loop's body once
        cell += f", {r['micro']} micro-batches"
        flops = "- (a loop)"
    ms = (f" {r['ms']:.3g} |" if r.get("ms") is not None else " - |") if timed else ""
    model = "-" if r.get("model") is None else f"{r['model']:.2f}"
    lines.append(f"| {r['mesh']} | {r['method']} | {cell} | {flops} |{ms} {model} | "
                 f"{r['seconds']:.1f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--meshes", nargs="+", default=list(MESHES))
  parser.add_argument("--target", default=None,
                      help="a GPU profile (t4, h100, ...): compile for 8 of them")
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  where = ("XLA:CPU, 8 emulated devices" if opts.target is None else
           f"XLA:GPU for 8 compile-only {opts.target} GPUs, planned on 8 emulated CPU devices")
  rows = []
  for name in opts.meshes:
    rows += rows_for(name, opts.target)
    print(table(rows), flush=True)
    _results.write(opts.out, "benchmarks/sharded.py", sys.argv[1:] if argv is None else argv,
                   "Sharded steps: per-device footprint and FLOPs on 8 devices", where,
                   table(rows), rows)


if __name__ == "__main__":
  main()

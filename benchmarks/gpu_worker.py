"""One measurement of ``benchmarks/gpu.py``, in a process of its own.

A process's allocator keeps one peak (``memory_stats()["peak_bytes_in_use"]``)
that nothing resets, so every configuration runs in a fresh process: the
peak it reads is that configuration's. The process reads a JSON job on
stdin and writes one JSON record on stdout; whatever goes wrong (a
``BudgetError``, an out-of-memory error, a JAX incompatibility) becomes the
record's ``status`` and ``error``, never a crash of the whole run.

Jobs (``job["kind"]``):
  env        what the machine is: JAX version, backend, device kind, memory.
  calibrate  ``jaxmem.calibrate()`` on the device, as a profile dict.
  measure    one model x method x budget: compile (footprints, host bytes,
             ``S(5)`` in the HLO), plan (jaxmem), run (peak, step time).
  maxbatch   the largest batch of one method under a fixed budget, from
             compiled footprints, then that batch run once for its peak.
  execute    a serialized executable run in a fresh process (the peak of a
             process that compiled includes autotuning's buffers).

Several workers plan and compile at once; a timed run has the GPU alone
(a file lock around warm-up, peak reading and timing, which compilations,
autotuning on the GPU, share), so step times are not measured against
each other's kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import statistics
import sys
import time
import traceback

# Before JAX starts: allocate on demand (no preallocation), so the
# allocator's peak is what the step needed.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxmem  # noqa: E402  (sets the XLA:CPU remat flag before the backend starts)
from jaxmem.targets import (  # noqa: E402
    DeviceProfile, copies_wait, get_profile, timing_profile)
from jaxmem.cost._evaluate import unplanned  # noqa: E402
from jaxmem import _flags  # noqa: E402
from jaxmem.targets import placed, resolve, xla_footprint  # noqa: E402
from jaxmem.cost._perf import predict_schedule  # noqa: E402
from jaxmem.cost._xla_clock import program_time  # noqa: E402
from jaxmem.targets._calibrate import QUEUED  # noqa: E402
from jaxmem.targets._calibrate import target_config  # noqa: E402
from jaxmem._zoo import models as _models  # noqa: E402
from jaxmem.planners import PLANNERS  # noqa: E402

PRESET = "h100"  # the preset nearest an H100/H200-class GPU
HOST_SPACE = "S(5)"  # XLA's memory-space annotation of pinned host buffers


def _analysis(compiled, job) -> dict:
  """The compiled program's memory figures and host annotations, and on a
  GPU (or for a GPU target) its time by the clock (``_xla_clock``: XLA:GPU's
  kernels priced on the job's profile and on the preset)."""
  stats = compiled.memory_analysis()
  fields = ("temp", "argument", "output", "alias", "host_temp", "host_argument",
            "host_output")
  record = {f"{f}_bytes": None if stats is None else int(getattr(stats, f"{f}_size_in_bytes", 0))
            for f in fields}
  record["footprint"] = xla_footprint(compiled)
  record["host_bytes"] = sum(record[f"host_{f}_bytes"] or 0
                             for f in ("temp", "argument", "output"))
  try:
    text = compiled.as_text()
  except Exception:  # noqa: BLE001 - some backends give no text
    record["hlo_host_annotations"] = None
    return record
  record["hlo_host_annotations"] = text.count(HOST_SPACE)
  if job.get("target") or jax.default_backend() == "gpu":
    for label, profile in (("calibrated", _profile(job)), ("preset", get_profile(PRESET))):
      record[f"clock_ms_{label}"] = program_time(text, profile).seconds * 1e3
  return record


@contextlib.contextmanager
def _gpu_lock(path: str | None, shared: bool = False):
  """Holds the GPU through ``path``'s lock: alone for a timed run, or
  (``shared``) beside other compilations, which autotune kernels on the
  GPU and would otherwise run inside another worker's timed steps. A run
  that waits goes before compilations that start after it (it holds the
  turnstile file while it waits), so it waits for the compilations under
  way, not for every later one."""
  if not path:
    yield
    return
  with open(path + ".turnstile", "a") as turnstile, open(path, "a") as handle:
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    if shared:
      fcntl.flock(turnstile, fcntl.LOCK_UN)
    fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def _peak() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def _update_norms(args, out) -> list[float]:
  """The step's numbers in brief: for each float leaf of the state, its
  update's (output less input) norm and its dot product with a fixed random
  probe; then the loss. Runs of the same model and batch compare them with
  the unmodified step's (``gpu.py``). The state holds the optimizer's
  moments (Adam's first is a tenth of the gradient), so a gradient wrong
  in scale moves a norm and one wrong in direction (permuted, a slice
  shifted) moves a probe's product (offload inside loops has given wrong
  gradients in some XLA releases)."""
  figures = []
  pairs = zip(jax.tree_util.tree_leaves(args[0]), jax.tree_util.tree_leaves(out[0]))
  for i, (before, after) in enumerate(pairs):
    if not jnp.issubdtype(before.dtype, jnp.floating):
      continue
    move = (after - before).astype(jnp.float32)
    probe = jax.random.normal(jax.random.key(i), move.shape, jnp.float32)
    figures += [float(jnp.linalg.norm(move)), float(jnp.vdot(move, probe))]
  return figures + [float(jax.tree_util.tree_leaves(out[1])[0])]


def _in_device_memory(tree):
  """``tree``'s arrays in device memory (a step's outputs in host memory
  come back)."""
  return jax.tree_util.tree_map(
      lambda a: jax.device_put(a, a.sharding.with_memory_kind("device")), tree)


def _execute(compiled, given, repeats: int, lock: str | None) -> dict:
  """Runs a compiled step on ``given`` (arrays on the host, from
  :func:`_host_arguments`): the allocator's peak after warm-up steps and
  the median step time, with steps queued as a training loop runs them
  (``step_ms``: the host dispatches the next step while the GPU runs
  this one) and with each step waited for (``call_ms``: adds the host's
  dispatch and wait, 3-5 ms a step of the zoo's on an H100, which the
  clock does not price). The peak before the first run (compilation's
  autotuning allocates too) is recorded; where the step did not raise it,
  the step's own peak is hidden under it (``peak_masked``). ``given``
  stays on the host, the reference the update is summed against: a device
  copy of it would count in the peak of a plan that keeps the state in
  host memory."""
  # Where the plan keeps optimizer state in host memory, the executable
  # takes those leaves there (the transformed step places them itself; a
  # deserialized executable does not).
  args = jax.device_put(tuple(given), compiled.input_shardings[0])
  with _gpu_lock(lock):
    before = _peak()
    for _ in range(2):  # each result dropped before the next call, as in a loop
      jax.block_until_ready(compiled(*args))
    peak = _peak()
    times, loss = [], None
    for _ in range(max(repeats, 1)):
      start = time.perf_counter()
      out = jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - start)
      if isinstance(out, tuple) and len(out) > 1:
        loss = jax.tree_util.tree_leaves(out[1])[0]
      del out
    queued = _queued_seconds(compiled, args, max(repeats, 1))
    # After the peak is read: summing up the numbers holds both states.
    moves = _update_norms(given, _in_device_memory(compiled(*args)))
  return {"peak_bytes": peak, "peak_before_run": before, "update_norms": moves,
          "peak_masked": peak is not None and before is not None and peak <= before,
          "step_ms": queued * 1e3, "call_ms": statistics.median(times) * 1e3,
          "loss_finite": None if loss is None else bool(math.isfinite(float(loss)))}


def _queued_seconds(compiled, args, repeats: int) -> float:
  """Median seconds a step takes with ``QUEUED`` steps dispatched back to
  back, as a training loop runs them: each result dropped as the next is
  dispatched (one step's outputs held at a time, as in a loop), then the
  last waited for (one stream runs them in order)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = None
    for _ in range(QUEUED):
      out = compiled(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / QUEUED)
    del out
  return statistics.median(times)


def _run_fresh(compiled, job, batch: int | None = None) -> dict:
  """Runs a compiled step in a fresh process (``execute`` job), so that the
  allocator's peak is the step's alone: compiling (autotuning) allocates in
  this process. Falls back to running here where the executable cannot be
  serialized (``peak_in_process`` says so)."""
  import subprocess
  import tempfile
  from jax.experimental import serialize_executable
  try:
    payload, _, _ = serialize_executable.serialize(compiled)
  except Exception as err:  # noqa: BLE001 - the fallback is reported
    record = _execute(compiled, _host_arguments(_task(job, batch)), job["repeats"],
                      job.get("lock"))
    return dict(record, peak_in_process=True, fresh_error=f"{type(err).__name__}: {err}"[:500])
  with tempfile.NamedTemporaryFile(suffix=".xla", delete=False) as handle:
    handle.write(payload)
  try:
    child = dict(job, kind="execute", executable=handle.name, batch=batch)
    done = subprocess.run([sys.executable, __file__], input=json.dumps(child), text=True,
                          capture_output=True, timeout=600)
  finally:
    os.unlink(handle.name)
  marker = done.stdout.rfind("@@RESULT@@")
  if marker < 0:
    return {"status": "crashed", "error": done.stderr[-2000:]}
  record = json.loads(done.stdout[marker + len("@@RESULT@@"):])
  record.pop("seconds", None)
  return record


def execute(job) -> dict:
  """Loads a serialized step and runs it on fresh arguments (see
  :func:`_run_fresh`)."""
  from jax.experimental import serialize_executable
  task = _task(job, job.get("batch"))
  args = _host_arguments(task)
  in_tree = jax.tree_util.tree_structure((tuple(args), {}))
  out_tree = jax.tree_util.tree_structure(jax.eval_shape(task.step, *args))
  with open(job["executable"], "rb") as handle:
    compiled = serialize_executable.deserialize_and_load(handle.read(), in_tree, out_tree)
  return dict(_execute(compiled, args, job["repeats"], job.get("lock")), status="ok")


def _profile(job) -> DeviceProfile:
  """The profile calibrated on the GPU, else the target's preset (a dry
  run for ``--target t4`` plans for a T4), else the H100's."""
  found = job.get("profile")
  return DeviceProfile.from_dict(found) if found else get_profile(job.get("target") or PRESET)


def _planner(job):
  """The jaxmem planner of a ``jaxmem:<name>`` job, for the job's profile
  with host copies timed as XLA:GPU schedules them (``timing_profile``)."""
  return PLANNERS[job["method"].split(":", 1)[1]](target=timing_profile(_profile(job)))


def _task(job, batch: int | None = None):
  method = job["method"]
  remat = method.split(":", 1)[1] if method.startswith("remat:") else None
  config = dict(job["config"], **({} if batch is None else {"batch": batch}))
  zoo = config.pop("zoo", job["model"])  # a configuration's zoo model, where named
  return _models().get(zoo, remat=remat, **config)


def _arguments(task, job):
  """Real arrays on the device, or shapes only for a dry run (placed on the
  job's GPU target, a compile-only device, where it names one: every
  method then compiles for that GPU here). The arrays are made on the host
  and copied over: made on the device, the initializer's own temporaries
  (6 GiB for the U-Net's batch) would set the allocator's peak above the
  step's."""
  if job["dry_run"]:
    shapes = jax.eval_shape(task.init)
    return placed(shapes, job["target"]) if job.get("target") else shapes
  return jax.device_put(_host_arguments(task), jax.devices()[0])


def _host_arguments(task):
  """The task's arrays, made and kept on the host (numpy)."""
  with jax.default_device(jax.devices("cpu")[0]):
    return jax.device_get(task.init())


def _predictions(schedule, graph, profile) -> dict:
  """Predicted step time of a schedule on the calibrated profile and the
  preset, with the untransformed step's beside them."""
  record = {}
  for label, timed_on in (("calibrated", profile), ("preset", get_profile(PRESET))):
    seconds = predict_schedule(schedule, timed_on).seconds
    base = predict_schedule(unplanned(graph, 0).schedule, timed_on).seconds
    record[f"predicted_ms_{label}"] = seconds * 1e3
    record[f"predicted_ratio_{label}"] = seconds / base if base else None
  return record


def _compile_jaxmem(job, step, args, record) -> object | None:
  """Plans and compiles a jaxmem method; None where the budget cannot be
  met (``record`` says why)."""
  fitted = jaxmem.transform(step, budget=job["budget_bytes"], planner=_planner(job))
  start = time.perf_counter()
  try:
    fit = fitted.fit(*args)
  except jaxmem.BudgetError as err:
    record.update(status="no-fit", smallest=err.smallest,
                  planning_s=time.perf_counter() - start)
    return None
  record.update(planning_s=time.perf_counter() - start, model_peak=fit.memory.peak,
                plan_offloads=fit.result.plan.uses_host,
                plan_size=len(fit.result.plan), added_flops=fit.added_flops,
                base_flops=fit.base_flops)
  record.update(_predictions(fit.memory.schedule, fit.graph, _profile(job)))
  return fitted.lower(*args).compile()


def _compile(job, step, args, record):
  method = job["method"]
  if method.startswith("jaxmem:"):
    return _compile_jaxmem(job, step, args, record)
  lowered = _jit(job, step).lower(*args)
  if method == "xla:remat":
    # XLA:GPU's own rematerialization, its limit scaled to the budget as
    # closely as the integer percentage flag allows.
    return _xla_remat(job, lowered, job["slop"], job["budget_bytes"], record)
  compiled = lowered.compile()
  if method == "unconstrained":
    analysis = jaxmem.analyze(step, *args)
    record.update(_predictions(analysis.memory.schedule, analysis.graph, _profile(job)))
  return compiled


def _options(job) -> dict:
  """Compiler options for plain ``jax.jit`` compilations of the job: a GPU
  target's (which take back the XLA:CPU flag a CPU-only process sets), or
  this machine's."""
  if job.get("target"):
    return resolve(job["target"], ()).options()
  return _flags.compiler_options(jax.default_backend())


def _jit(job, step):
  return jax.jit(step, compiler_options=_options(job) or None)


def _xla_remat(job, lowered, slop: int, budget: int, record, tries: int = 3):
  """XLA:GPU's own rematerialization at the largest memory-limit percentage
  (``xla_gpu_memory_limit_slop_factor``) near ``slop`` whose compiled
  footprint is within ``budget``; the smallest tried where none is."""
  compile_at = lambda s: lowered.compile(
      compiler_options={**_options(job), "xla_gpu_memory_limit_slop_factor": s})
  tried = {slop: compile_at(slop)}
  fits = lambda s: (xla_footprint(tried[s]) or 0) <= budget
  step = 1 if fits(slop) else -1
  while len(tried) < tries and 1 <= slop + step <= 100:
    tried[slop + step] = compile_at(slop + step)
    if fits(slop + step) != (step > 0):  # went over, or came under
      slop = slop + step if step < 0 else slop
      break
    slop += step
  record["xla_slop_percent"] = slop
  record["xla_slop_tried"] = {s: xla_footprint(c) for s, c in tried.items()}
  return tried[slop]


def measure(job) -> dict:
  """One model x method x budget (see the module docstring)."""
  record = {"status": "ok"}
  task = _task(job)
  args = _arguments(task, job)
  start = time.perf_counter()
  with _gpu_lock(job.get("lock"), shared=True):
    compiled = _compile(job, task.step, args, record)
  if compiled is None:
    return record
  record["compile_s"] = time.perf_counter() - start
  record.update(_analysis(compiled, job))
  if not job["dry_run"]:
    del args  # the fresh process makes its own
    record.update(_run_fresh(compiled, job))
  budget = job.get("budget_bytes")
  if budget:
    record["fits_compiled"] = record["footprint"] is not None and record["footprint"] <= budget
    if record.get("peak_bytes") is not None:
      record["fits_measured"] = record["peak_bytes"] <= budget
  return record


def _stepper(job, batch: int):
  """The job's step at ``batch`` as it is compiled: ``jax.jit`` of the
  (per-block remat) step, or jaxmem's transform of it, which keeps a fit
  that succeeds so the final run does not plan again."""
  task = _task(job, batch)
  if job["method"].startswith("jaxmem:"):
    return task, jaxmem.transform(task.step, budget=job["budget_bytes"], planner=_planner(job))
  return task, _jit(job, task.step)


def _fits(stepper, shapes, budget: int) -> bool:
  """Whether a step from ``_stepper`` fits ``budget``, compiled only."""
  if isinstance(stepper, jaxmem.Transformed):
    return stepper.can_fit(*shapes)
  footprint = xla_footprint(stepper.lower(*shapes).compile())
  return footprint is not None and footprint <= budget


def max_batch(job) -> dict:
  """The largest batch (in steps of ``job["step"]``, up to ``job["limit"]``)
  at which the method fits the budget, by bisection over compiled
  footprints; then, on a device, that batch run once for its peak."""
  unit, limit = job["step"], job["limit"]
  low, high, probes, best = 0, limit // unit + 1, [], None
  with _gpu_lock(job.get("lock"), shared=True):
    while high - low > 1:
      mid = (low + high) // 2
      task, stepper = _stepper(job, mid * unit)
      shapes = _arguments(task, dict(job, dry_run=True))
      ok = _fits(stepper, shapes, job["budget_bytes"])
      probes.append((mid * unit, ok))
      low, high = (mid, high) if ok else (low, mid)
      best = (stepper, shapes) if ok else best
    compiled = best and not job["dry_run"] and best[0].lower(*best[1]).compile()
  record = {"status": "ok", "max_batch": low * unit, "probes": probes}
  if compiled:
    record.update(_run_fresh(compiled, dict(job, repeats=3), low * unit))
    record["status"] = "ok" if record.get("status", "ok") == "ok" else record["status"]
  if record.get("peak_bytes") is not None:
    record["fits_measured"] = record["peak_bytes"] <= job["budget_bytes"]
  return record


def environment(job) -> dict:
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  import jaxlib
  return {"status": "ok", "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "backend": jax.default_backend(), "device_kind": device.device_kind,
          "devices": jax.device_count(), "bytes_limit": stats.get("bytes_limit"),
          "memory_kinds": sorted(m.kind for m in device.addressable_memories()),
          "python": sys.version.split()[0]}


def calibrate(job) -> dict:
  """The calibrated profile, and XLA's own description of the device as it
  came (``target_config``: its type and text, or why it could not be read),
  so a profile without a description says why; and whether XLA here waits
  for each host copy where it issues it (``copies_wait``: the planners then
  time copies as stalls; None off a GPU)."""
  record = {"status": "ok", "profile": jaxmem.calibrate().to_dict(),
            "copies_wait": copies_wait(resolve(None, [jax.device_put(jnp.zeros(2))]))}
  try:
    config = target_config(jax.devices()[0])
    record["target_config"] = {"type": type(config).__name__, "text": str(config)[:8000]}
  except Exception as err:  # noqa: BLE001 - a private API; the failure is the finding
    record["target_config"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
  return record


JOBS = {"env": environment, "calibrate": calibrate, "measure": measure,
        "maxbatch": max_batch, "execute": execute}


def main() -> None:
  job = json.loads(sys.stdin.read())
  start = time.perf_counter()
  try:
    record = JOBS[job["kind"]](job)
  except Exception as err:  # noqa: BLE001 - every failure is a reported result
    text = f"{type(err).__name__}: {err}"
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    record = {"status": "oom" if oom else "error", "error": text[:2000],
              "traceback": traceback.format_exc()[-3000:]}
  record["seconds"] = time.perf_counter() - start
  sys.stdout.write("\n@@RESULT@@" + json.dumps(record, default=str) + "\n")


if __name__ == "__main__":
  main()

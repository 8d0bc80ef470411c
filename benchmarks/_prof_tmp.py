"""Per-kernel device times of unmodified zoo steps (a profiler trace),
with each step's compiled program, for checking the clock kernel by kernel."""
import glob, json, os, sys, time
import jax
sys.path[:0] = ["tests", "benchmarks"]
from jaxmem._zoo import models as _zoo
models = _zoo()
import gpu

out = os.environ.get("OUT", "/tmp/work/prof")
os.makedirs(out, exist_ok=True)
summary = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
for name in sys.argv[1:]:
  t0 = time.perf_counter()
  task = models.get(name, **gpu.CONFIGS[name])
  with jax.default_device(jax.devices("cpu")[0]):
    host = jax.device_get(task.init())
  args = jax.device_put(host, jax.devices()[0])
  compiled = jax.jit(task.step).lower(*args).compile()
  open(f"{out}/{name}.hlo.txt", "w").write(compiled.as_text())
  for _ in range(3):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(5):
    s = time.perf_counter(); jax.block_until_ready(compiled(*args)); times.append(time.perf_counter() - s)
  trace = f"/tmp/trace-{name}"
  jax.profiler.start_trace(trace)
  for _ in range(3):
    jax.block_until_ready(compiled(*args))
  jax.profiler.stop_trace()
  path = glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[0]
  data = jax.profiler.ProfileData.from_file(path)
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device"):
      continue
    for line in plane.lines:
      for ev in line.events:
        stats = {}
        try:
          stats = {k: str(v) for k, v in ev.stats}
        except Exception:
          pass
        events.append([plane.name, line.name, ev.name, ev.start_ns, ev.duration_ns,
                       stats.get("hlo_op", ""), stats.get("hlo_module", "")])
  json.dump(events, open(f"{out}/{name}.events.json", "w"))
  summary[name] = {"step_s": sorted(times), "seconds": time.perf_counter() - t0,
                   "events": len(events), "planes": sorted({e[0] for e in events})}
  print(name, summary[name], flush=True)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)

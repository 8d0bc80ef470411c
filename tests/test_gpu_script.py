"""benchmarks/gpu.py, the prepared GPU check, works before it meets a GPU.

CI has no GPU: the dry run (lowering and planning only) walks the script's
configurations on CPU, and the report's judgments (budget violations,
offload plans without host buffers, ratios) are checked on records made here.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu  # noqa: E402

from jaxmem._zoo import models  # noqa: E402

GIB = 2**30


def _dry_run(tmp_path, *options):
  out = tmp_path / "out"
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--dry-run", "--quick",
       "--out", str(out), *options],
      capture_output=True, text=True, timeout=1800, cwd=ROOT)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_dry_run_plans_and_lowers_every_kind_of_method(tmp_path):
  """One model through every kind of method: the unmodified step, a remat
  offload policy, a jaxmem planner, XLA's own remat (at the zoo's CPU
  sizes: the edge sizes take minutes to plan on two cores)."""
  result, text = _dry_run(tmp_path, "--cpu-sizes", "--models", "resnet18", "--planners",
                          "lgm", "--budgets", "80%", "--remat",
                          "offload_dot_with_no_batch_dims")
  rows = {r["method"]: r for r in result["rows"]}
  assert set(rows) == {"unconstrained", "remat:offload_dot_with_no_batch_dims",
                       "jaxmem:lgm", "xla:remat"}
  assert all(r["status"] in ("ok", "no-fit") for r in rows.values()), rows
  base = rows["unconstrained"]["footprint"]
  assert rows["jaxmem:lgm"]["budget_bytes"] == int(base * 0.8)
  assert rows["unconstrained"]["predicted_ms_preset"] > 0
  assert result["provenance"]["command"].startswith("python benchmarks/gpu.py --dry-run")
  assert result["environment"]["backend"] == "cpu"
  assert "| resnet18 | jaxmem:lgm | 80% |" not in text  # budgets are printed with bytes
  assert "| resnet18 | jaxmem:lgm | 80% (" in text
  assert rows["unconstrained"]["config"] == models().CPU_SIZES["resnet18"]


@pytest.mark.slow
def test_dry_run_quick_exits_zero(tmp_path):
  """The exact command the guide names (docs/bench.md; minutes on 2 cores)."""
  result, _ = _dry_run(tmp_path)
  assert {r["model"] for r in result["rows"]} == set(gpu.QUICK["models"])


def _rows():
  env = {"kind": "env", "status": "ok", "backend": "gpu", "device_kind": "GPU", "jax": "x"}
  prov = {"kind": "provenance", "status": "ok", "command": "c", "commit": "abc",
          "dirty": False, "date": "d"}
  base = {"kind": "measure", "model": "m", "method": "unconstrained", "budget": "-",
          "budget_bytes": None, "status": "ok", "footprint": 4 * GIB, "peak_bytes": 4 * GIB,
          "step_ms": 10.0, "hlo_host_annotations": 0}
  over = dict(base, method="jaxmem:recompute", budget="50%", budget_bytes=2 * GIB,
              footprint=2 * GIB - 10, peak_bytes=2 * GIB + 10, fits_measured=False,
              step_ms=15.0, plan_offloads=False)
  lost = dict(base, method="jaxmem:hybrid", budget="50%", budget_bytes=2 * GIB,
              footprint=GIB, peak_bytes=GIB, fits_measured=True, plan_offloads=True,
              hlo_host_annotations=0, step_ms=20.0)
  good = dict(lost, method="jaxmem:lgm", hlo_host_annotations=12)
  return [prov, env, base, over, lost, good]


def test_report_names_violations_and_offloads_without_host_buffers():
  result = gpu.assemble(_rows())
  found = "\n".join(gpu.problems(result))
  assert "m jaxmem:recompute 50%: measured peak" in found
  assert "m jaxmem:hybrid 50%: an offload plan with no S(5)" in found
  assert "jaxmem:lgm" not in found
  ratios = {r["method"]: r.get("time_ratio") for r in result["rows"]}
  assert ratios == {"unconstrained": 1.0, "jaxmem:recompute": 1.5, "jaxmem:hybrid": 2.0,
                    "jaxmem:lgm": 2.0}
  text = gpu.markdown(result)
  assert "| m | jaxmem:recompute | 50% (2.00) | ok |" in text and "**no**" in text


def test_checks_judge_the_clock_by_its_time_and_by_its_slowdowns():
  """A clock off by a constant factor fails the time check and passes the
  slowdown check (what orders one model's plans); one that misjudges a
  method's slowdown fails it. A remat offload policy that names no residual
  of the model (no S(5) buffer) is not a problem; a jaxmem offload plan is."""
  base = dict(_rows()[2], clock_ms_calibrated=8.0)
  slower = dict(base, method="remat:dots_saveable", step_ms=12.0, clock_ms_calibrated=9.6)
  wrong = dict(base, method="remat:nothing_saveable", step_ms=12.0, clock_ms_calibrated=8.4)
  policy = dict(base, method="remat:offload_dot_with_no_batch_dims", step_ms=10.0,
                clock_ms_calibrated=8.0)
  result = gpu.assemble(_rows()[:2] + [base, slower, wrong, policy])
  lines = gpu.checks(result)
  assert "within 15% of the measured time (calibrated profile): 0 of 4" in lines[1]
  assert "within 5% of the measured ones: 2 of 3; clock / measured from 0.88 to 1.00" \
      in lines[2]
  assert gpu.problems(result) == []


def test_render_rebuilds_the_tables_from_a_cut_run(tmp_path):
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
  assert gpu.main(["--render", str(rows)]) == 0
  result = json.loads((tmp_path / "results.json").read_text())
  assert result["provenance"]["commit"] == "abc" and len(result["rows"]) == 4


def test_xla_memory_limit_percentage_stays_under_the_budget():
  memory = 100 * GIB
  assert gpu._slop(int(0.8 * memory * 0.05), memory) == 5
  assert gpu._slop(int(0.8 * memory * 0.0499), memory) == 4
  assert gpu._slop(GIB, memory) == 1 and gpu._slop(GIB, None) == 1


@pytest.mark.parametrize("backend, want, wrong, rounded, shown", [
    # CPU: each figure against its own; rounding noise on one near zero is not
    # wrong numbers, 1% off on a real figure is.
    ("cpu", [1.0, 0.5, 2e-9, 1e-9, 300.0], [1.0, 0.505, 3e-9, 1e-9, 300.0],
     [1.0 + 1e-6, 0.5, 5e-9, -1e-9, 300.0], "**no** (1.0e-02)"),
    # GPU: Adam's sign flips move a probe's product by a tenth of its leaf's
    # norm; one leaf's update permuted moves it by the norm (sqrt(1 / 2)).
    ("gpu", [1.0, 0.5, 1.0, -0.3, 300.0], [1.0, -0.5, 1.0, -0.3, 300.0],
     [1.0, 0.6, 1.0 + 1e-5, -0.3, 300.0], "**no** (7.1e-01)"),
])
def test_report_names_a_run_whose_numbers_differ(backend, want, wrong, rounded, shown):
  """Each run's update figures (norm and probe's product per float leaf, then
  the loss) are judged against the unmodified step's, by the backend's rule;
  a large loss loosens nothing."""
  rows = _rows()
  rows[1]["backend"] = backend
  rows[2]["update_norms"] = want
  rows[3]["update_norms"] = wrong
  rows[4]["update_norms"] = rounded
  result = gpu.assemble(rows)
  judged = {r["method"]: r.get("same_numbers") for r in result["rows"]}
  assert judged == {"unconstrained": True, "jaxmem:recompute": False,
                    "jaxmem:hybrid": True, "jaxmem:lgm": None}
  assert "m jaxmem:recompute 50%: its update norms differ" in "\n".join(gpu.problems(result))
  assert shown in gpu.markdown(result)
  # The loss is judged against itself, by either rule.
  assert gpu.numbers_error(want[:-1] + [301.0], want, backend) == pytest.approx(1 / 300)


def test_the_worker_sums_up_a_step_by_update_norms_and_probes():
  """A permuted update keeps its norm but not its probe's product."""
  import jax.numpy as jnp
  import gpu_worker
  state = {"w": jnp.ones(4), "step": jnp.array(3)}
  moved = lambda d: ({"w": jnp.ones(4) + jnp.array(d), "step": jnp.array(4)}, 2.5)
  got = gpu_worker._update_norms((state, None), moved([3.0, 4.0, 0.0, 0.0]))
  permuted = gpu_worker._update_norms((state, None), moved([0.0, 0.0, 4.0, 3.0]))
  assert len(got) == 3 and got[0] == 5.0 and got[2] == 2.5
  assert permuted[0] == 5.0 and abs(permuted[1] - got[1]) > 1e-3 * abs(got[1])


def test_a_timed_run_waits_for_compilations_under_way_and_goes_before_later_ones(tmp_path):
  """Compilations (autotuning on the GPU) share the lock; a timed run takes
  it alone, after the compilation under way and before one that starts
  while it waits."""
  import threading
  import time
  import gpu_worker
  lock, order = str(tmp_path / "gpu.lock"), []
  compiling, waiting = threading.Event(), threading.Event()

  def hold(name, shared, started=None, after=None, seconds=0.0):
    if after:
      after.wait()
      time.sleep(0.2)
    with gpu_worker._gpu_lock(lock, shared=shared):
      if started:
        started.set()
      order.append(f"{name} in")
      time.sleep(seconds)
      order.append(f"{name} out")

  threads = [threading.Thread(target=hold, args=("compile", True, compiling, None, 0.6)),
             threading.Thread(target=hold, args=("run", False, None, compiling)),
             threading.Thread(target=hold, args=("later compile", True, waiting, compiling))]
  threads[0].start()
  threads[1].start()
  time.sleep(0.35)  # the run waits for the first compilation
  threads[2].start()
  for thread in threads:
    thread.join(10)
  assert order.index("compile out") < order.index("run in") < order.index("run out") \
      < order.index("later compile in"), order


def test_a_run_finds_max_batch_only_for_the_models_it_names():
  assert gpu.run_plan(gpu.parse(["--models", "gpt2"]))["max_batch"] == ("gpt2",)
  assert gpu.run_plan(gpu.parse(["--models", "vit"]))["max_batch"] == ()
  assert gpu.run_plan(gpu.parse([]))["max_batch"] == gpu.MAX_BATCH
  assert gpu.run_plan(gpu.parse(["--quick", "--max-batch", "vit"]))["max_batch"] == ("vit",)


def test_the_workers_share_autotuning_results_through_one_folder(tmp_path, monkeypatch):
  folder = str(tmp_path / "autotune")
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  flags = gpu.Runner(False, 1, 1, None, autotune_cache=folder).env["XLA_FLAGS"].split()
  assert flags == ["--xla_dump_to=/tmp/d", f"--xla_gpu_per_fusion_autotune_cache_dir={folder}"]
  assert os.path.isdir(folder)
  # A folder the user's flags already name is theirs; none asked for, none set.
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_per_fusion_autotune_cache_dir=/mine")
  assert gpu.Runner(False, 1, 1, None, autotune_cache=folder).env["XLA_FLAGS"] == \
      "--xla_gpu_per_fusion_autotune_cache_dir=/mine"
  monkeypatch.delenv("XLA_FLAGS")
  assert "XLA_FLAGS" not in gpu.Runner(False, 1, 1, None).env
  assert gpu.parse([]).autotune_cache == gpu.AUTOTUNE_CACHE


def test_the_worker_places_arguments_where_the_executable_takes_them():
  """A plan that keeps optimizer state in host memory compiles to an
  executable that takes those leaves there; the worker is handed the
  arguments on the host (numpy, so that no device copy of the state beside
  the executable's counts in the measured peak) and places them where the
  executable takes them, and sums up the update from the step's outputs
  in host memory."""
  import jax
  import jax.numpy as jnp
  import gpu_worker
  device = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  step = jax.jit(lambda state, x: ((state[0], state[1] + x.sum()), x.sum()),
                 in_shardings=((host, None), None), out_shardings=((host, None), None))
  state, batch = (jnp.ones(4), jnp.ones(2)), jnp.ones(4)
  compiled = step.lower((jax.device_put(state[0], host), state[1]), batch).compile()
  record = gpu_worker._execute(compiled, jax.device_get((state, batch)), 2, None)
  assert record["update_norms"] == pytest.approx([0.0, 0.0, 32**0.5, record["update_norms"][3], 4.0])


# Two dry runs at ResNet-18's edge size, planned on the T4 and on the CPU:
# about four minutes on two cores.
@pytest.mark.slow
def test_dry_run_for_a_gpu_target_compiles_every_method_with_xla_gpu(tmp_path):
  """``--dry-run --target t4``: the unmodified step, a remat policy (whose
  barriers XLA:GPU refuses under the XLA:CPU flag this process sets), a
  jaxmem planner and XLA's own remat are compiled for a T4 here, and the
  unmodified footprint is XLA:GPU's, not XLA:CPU's."""
  result, _ = _dry_run(tmp_path, "--target", "t4", "--models", "resnet18", "--planners",
                       "recompute", "--budgets", "80%", "--remat", "nothing_saveable")
  rows = {r["method"]: r for r in result["rows"]}
  assert set(rows) == {"unconstrained", "remat:nothing_saveable", "jaxmem:recompute",
                       "xla:remat"}
  assert all(r["status"] in ("ok", "no-fit") for r in rows.values()), rows
  here, _ = _dry_run(tmp_path / "cpu", "--models", "resnet18", "--planners", "recompute",
                     "--budgets", "80%", "--remat")
  on_cpu = {r["method"]: r for r in here["rows"]}["unconstrained"]["footprint"]
  assert rows["unconstrained"]["footprint"] != on_cpu
  assert rows["jaxmem:recompute"]["budget_bytes"] == int(rows["unconstrained"]["footprint"] * 0.8)


def _worker(**job):
  job = {"kind": "measure", "model": "mlp", "config": {}, "method": "unconstrained",
         "budget": "-", "budget_bytes": None, "dry_run": False, "repeats": 2, "lock": None,
         "target": None, "profile": None, **job}
  done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_worker.py")],
                        input=json.dumps(job), capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
  text = done.stdout
  record = json.loads(text[text.rfind("@@RESULT@@") + len("@@RESULT@@"):])
  assert record["status"] == "ok", record.get("traceback", record)
  return record


def test_the_worker_runs_a_step_here_as_on_a_gpu():
  """A measurement that is not a dry run: compiled, serialized, run in a
  fresh process on fresh arguments, and summed up, on this machine's
  backend; the path the GPU run takes after compiling."""
  record = _worker()
  assert record["step_ms"] > 0 and record["loss_finite"]
  assert len(record["update_norms"]) % 2 == 1 and "fresh_error" not in record
  assert "clock_ms_calibrated" not in record  # an XLA:CPU program has no GPU kernels


def test_the_worker_times_a_gpu_program_by_the_clock():
  """For a GPU target (and on a GPU), every compiled program is priced by
  the clock, on the target's profile and on the preset."""
  record = _worker(dry_run=True, target="t4")
  assert record["clock_ms_calibrated"] > record["clock_ms_preset"] > 0  # a T4 is slower


def test_report_states_the_two_claims_a_gpu_run_confirms():
  """Plans within their budgets by the measured peak, and the clock within
  15% of the measured step times, each counted over the run's rows."""
  rows = _rows()
  rows[2]["clock_ms_calibrated"] = 11.0  # 1.10x the measured 10 ms
  rows[3]["clock_ms_calibrated"] = 18.0  # 1.20x the measured 15 ms
  result = gpu.assemble(rows)
  found = gpu.checks(result)
  assert found[0].endswith("by the measured peak: 2 of 3")
  assert "within 15% of the measured time (calibrated profile): 1 of 2; " \
         "clock / measured from 1.10 to 1.20" in found[1]
  assert "| 11.0 / - | 1.10 |" in gpu.markdown(result)

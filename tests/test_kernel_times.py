"""The clock set kernel by kernel beside an H100's profiler trace
(``benchmarks/kernel_times.py`` on the recorded ResNet-18 step): every
kernel XLA emitted is one the clock prices, and the library calls pair up
with the kernels they launched."""

import gzip
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import kernel_times  # noqa: E402

RECORDED = os.path.join(ROOT, "benchmarks", "results", "kernel-times-h100")


def _recorded(model):
  with gzip.open(os.path.join(RECORDED, f"{model}.hlo.txt.gz"), "rt") as f:
    text = f.read()
  with gzip.open(os.path.join(RECORDED, f"{model}.events.json.gz"), "rt") as f:
    return text, json.load(f)


def test_the_clock_prices_each_kernel_of_the_traced_step():
  text, events = _recorded("resnet18")
  steps = kernel_times.steps(events)
  assert len(steps) == kernel_times.TRACED_STEPS
  assert len({len(step) for step in steps}) == 1  # the same kernels each step
  row = kernel_times.compare(text, steps[-1], kernel_times.profile_from("h100"))
  # One priced kernel for each kernel of XLA's own in the trace.
  assert row["xla_kernels"] == row["traced_xla_kernels"] > 200
  # Every call is set against kernels it launched: each of ResNet-18's 59
  # convolutions (20 forward, 20 filter and 19 input gradients) is one.
  targets = [t for c in row["calls"] for t in c["targets"].split(",")]
  assert (targets.count("convForward"), targets.count("convBackwardFilter"),
          targets.count("convBackwardInput")) == (20, 20, 19)
  assert all(c["traced_ms"] > 0 and c["clock_ms"] > 0 for c in row["calls"])


def test_a_trace_splits_into_steps_at_its_widest_gaps():
  """Steps are found at the widest gaps between kernels; a trace whose
  steps ran different kernels is refused."""
  kernel = lambda start: ["loop_add_fusion", start, 10]
  trace = [kernel(t) for t in (0, 20, 40, 1000, 1020, 1040, 2000, 2020, 2040)]
  assert [len(s) for s in kernel_times.steps(trace)] == [3, 3, 3]
  assert kernel_times.steps(trace[:3], 1) == [trace[:3]]
  with pytest.raises(ValueError, match="not the same step"):
    kernel_times.steps(trace[:-1])


def test_calls_that_do_not_pair_up_are_an_error():
  """A trace of another program (here: without its library kernels) is
  refused, not paired off by position."""
  text, events = _recorded("resnet18")
  own = [e for e in kernel_times.steps(events)[-1] if not kernel_times.is_library(e[0])]
  with pytest.raises(ValueError, match="do not pair up"):
    kernel_times.compare(text, own, kernel_times.profile_from("h100"))

"""calibrate()'s spread on a GPU: the matmul rate and memory bandwidth it
fits, timed with one call per sample and with eight queued calls, on an idle
host and under load (12 busy processes), three medians of ten samples each;
then calibrate() itself. Writes ``$OUT/calib_probe.json`` (or /tmp's).

  PYTHONPATH=. python benchmarks/calibration_spread.py
"""
import json
import multiprocessing
import os

import jax
import jax.numpy as jnp

from jaxmem.targets import _calibrate as calibration

N, ELEMENTS = 4096, 2**26  # a 4096² fp32 matmul, a 256 MiB elementwise op


def _burn():
  while True:
    pass


def _sample(tag, out, a, big):
  matmul, elementwise = jax.jit(jnp.matmul), jax.jit(lambda x: x * 2.0)
  for calls in (1, calibration.QUEUED):
    rate = [2 * N**3 / calibration.median_seconds(matmul, (a, a), 10, calls) / 1e12
            for _ in range(3)]
    bandwidth = [2 * big.nbytes / calibration.median_seconds(elementwise, (big,), 10, calls)
                 / 1e12 for _ in range(3)]
    out[f"{tag} calls={calls}"] = {"tflops": [round(x, 1) for x in rate],
                                   "tb_s": [round(x, 3) for x in bandwidth]}
    print(tag, calls, out[f"{tag} calls={calls}"], flush=True)


def main():
  out = {}
  device = jax.devices()[0]
  a = jax.device_put(jnp.ones((N, N), jnp.float32), device)
  big = jax.device_put(jnp.ones(ELEMENTS, jnp.float32), device)
  _sample("idle", out, a, big)
  busy = [multiprocessing.get_context("spawn").Process(target=_burn) for _ in range(12)]
  for p in busy:
    p.start()
  try:
    _sample("12 busy processes", out, a, big)
  finally:
    for p in busy:
      p.terminate()
  profile = calibration.calibrate()
  out["calibrate"] = {"tflops": profile.flops / 1e12, "tb_s": profile.memory_bandwidth / 1e12,
                      "description": repr(profile.description)}
  print(out["calibrate"])
  with open(os.path.join(os.environ.get("OUT", "/tmp"), "calib_probe.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()

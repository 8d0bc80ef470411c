"""calibrate()'s spread on a GPU: the matmul and elementwise timings it fits, with one
call per sample and with queued calls, on an idle host and under load (12 busy
processes), three samples each; then calibrate() itself. Writes $OUT/calib_probe.json."""
import json, os, sys, threading, time
import jax, jax.numpy as jnp
from jaxmem.targets import _calibrate as k
out = {}
dev = jax.devices()[0]
a = jax.device_put(jnp.ones((4096, 4096), jnp.float32), dev)
big = jax.device_put(jnp.ones(2**26, jnp.float32), dev)
mm, ew = jax.jit(jnp.matmul), jax.jit(lambda x: x * 2.0)
def sample(tag):
  for calls in (1, 8):
    f = [2 * 4096**3 / k.median_seconds(mm, (a, a), 10, calls) / 1e12 for _ in range(3)]
    b = [2 * big.nbytes / k.median_seconds(ew, (big,), 10, calls) / 1e12 for _ in range(3)]
    out[f"{tag} calls={calls}"] = {"tflops": [round(x, 1) for x in f], "tb_s": [round(x, 3) for x in b]}
    print(tag, calls, out[f"{tag} calls={calls}"], flush=True)
sample("idle")
stop = False
def burn():
  x = 0
  while not stop: x += 1
ts = [threading.Thread(target=burn) for _ in range(4)]
import multiprocessing as mp
ps = [mp.Process(target=burn) for _ in range(12)]
for p in ps: p.start()
sample("12 busy processes")
for p in ps: p.terminate()
p = k.calibrate()
out["calibrate"] = {"tflops": p.flops / 1e12, "tb_s": p.memory_bandwidth / 1e12, "description": repr(p.description)}
print(out["calibrate"])
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "calib_probe.json"), "w"), indent=1)

"""planner="names" on the 4-layer Flax MLP of tests/test_names.py (names
up/act/down, batch 256) at four budgets, XLA:CPU: each fit's footprint
and budget, the policy written out, and XLA's footprint for the model
rewritten with nn.remat(Layer, policy=fit.name_policy()) against jaxmem's.

  JAX_PLATFORMS=cpu PYTHONPATH=.:tests python benchmarks/results/names-policy-mlp-cpu/run.py
"""
import subprocess

import jax

import jaxmem
from jaxmem.targets import xla_footprint
from test_names import Net, train_step

step, opt = train_step(Net())
x = jax.random.normal(jax.random.key(1), (256, 32))
params = Net().init(jax.random.key(0), x)
args = (params, opt.init(params), x)
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
print(f"commit {commit.strip()}, jax {jax.__version__}")
print("budget | fit footprint | budget bytes | saved | offloaded | policy in model | ratio")
for budget in ("85%", "75%", "65%", "50%"):
  fit = jaxmem.transform(step, budget=budget, planner="names").fit(*args)
  policy = fit.name_policy()
  theirs, _ = train_step(Net(policy=policy))
  footprint = xla_footprint(jax.jit(theirs).lower(*args).compile())
  print(f"{budget} | {fit.footprint} | {fit.budget} | {policy.saved} | {policy.offloaded} | "
        f"{footprint} | {footprint / fit.footprint:.3f}")

import sys, hashlib, time
root = sys.argv[1]
sys.path.insert(0, root)
import jaxmem, jax
try:
    from jaxmem.planners import PLANNERS
    from jaxmem._evaluate import evaluate
    from jaxmem._decisions import Plan
    import jaxmem_models as models
    new = True
except ImportError:
    from jaxmem._planners import PLANNERS, evaluate
    from jaxmem._plan import Plan
    import models
    new = False
from jaxmem._graph import build_graph
configs = [("mlp", dict(depth=8, width=64, batch=256, features=32)),
           ("transformer", {}), ("cnn", {})]
if len(sys.argv) > 2: configs += [("gpt2", {})]
for name, cfg in configs:
    task = models.get(name, **cfg)
    g = build_graph(jax.make_jaxpr(task.step)(*task.init()))
    base = evaluate(g, Plan())[1].peak
    for pname in ["recompute", "hybrid", "offload", "lgm", "lgm-whole"]:
        for frac in (0.7, 0.5):
            p = PLANNERS[pname]()
            t0 = time.time()
            r = p.plan(g, int(base * frac))
            h = hashlib.md5(repr(r.plan).encode()).hexdigest()[:8]
            print(name, pname, frac, r.peak, r.fits, len(r.plan), h, f"{time.time()-t0:.1f}s", flush=True)
        if pname in ("recompute", "hybrid"):
            low = p.lowest(g)
            print(name, pname, "lowest", [c.peak for c in low][:6], flush=True)

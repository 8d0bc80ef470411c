"""The package's shape, checked from its source with ``ast``: imports run
one way down the layers below (no cycle, no upward import, lazy imports
included), no private name crosses modules, and modules and functions stay
small enough to read."""

import ast
import functools
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxmem"

# Lowest first: a module imports only from layers below its own.
LAYERS = [
    {"_flags", "_provenance", "_budget", "_progress", "graph._primitives", "_decisions",
     "fit._batching", "targets._description", "targets._host_args", "targets._remesh",
     "cost._hlo", "cost._heap",
     "graph", "schedule", "cost", "fit"},  # the stage packages' own files hold no code
    {"fit._saved", "targets._profiles", "fit._unmet", "fit._arguments"},
    {"targets._compile", "targets._calibrate"},
    {"targets._copy_schedule"},
    {"targets"},
    {"fit._plan_cache"},
    {"graph._graph"},
    {"graph._xla_cpu_fusion", "graph._loops", "graph._state", "graph._axis_rules",
     "graph._random_bits"},
    {"graph._split"},
    {"graph._positions"},
    {"graph._scan_axes"},
    {"graph._batch_axes"},
    {"graph._feature_axes"},
    {"schedule._order"},
    {"schedule._schedule"},
    {"schedule._scan_remat"},
    {"schedule._loop_segments"},
    {"schedule._loop_schedule"},
    {"schedule._emit"},
    {"schedule._microbatch"},
    {"cost._xla_names"},
    {"cost._xla_unnamed"},
    {"cost._xla_buffers", "cost._xla_clock", "cost._xla_loops"},
    {"cost._learned_fusion"},
    {"cost._memory", "cost._perf", "cost._xla_shards"},
    {"cost._evaluate"},
    {"planners._blocks", "fit._inner", "fit._shared"},
    {"planners._base", "planners._choices", "planners._solution", "planners._scores"},
    {"planners._alike"},
    {"planners._pricing", "planners._highs", "planners._refine"},
    {"planners._greedy", "planners._hybrid", "planners._lgm", "planners._fixed",
     "planners._names"},
    {"fit._policies"},
    {"planners._ilp"},
    {"planners"},
    {"fit._forewarn", "fit._aims", "fit._trial", "fit._features"},
    {"fit._report", "fit._fit", "fit._host_state", "fit._checks", "fit._micro"},
    {"fit._search", "fit._jitting"},
    {"fit._traced"},
    {"fit._fitted"},
    {"_fitting"},
    {"_transform", "_analyze"},
    {""},  # the package itself: the public face
    {"_zoo", "_plots"},
    {"_benchmark"},
    {"bench"},
]
# Each stage package holds the modules of one stage of the flow, lowest
# first (a module of a lower stage never imports one of a higher stage):
STAGES = ["graph", "schedule", "cost", "planners", "fit"]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _name(path: pathlib.Path) -> str:
  """``jaxmem/planners/_lgm.py`` -> ``planners._lgm``; ``__init__`` -> its package."""
  parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
  return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_module(name: str) -> bool:
  return name in _modules()


def _imports(path: pathlib.Path) -> list[tuple[str, str | None, int]]:
  """(jaxmem module imported, name taken from it or None, line) for every
  import in the file, at any depth (lazy imports count)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name == "jaxmem" or alias.name.startswith("jaxmem."):
          found.append((alias.name[len("jaxmem."):] if "." in alias.name else "",
                        None, node.lineno))
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
        node.module == "jaxmem" or node.module.startswith("jaxmem.")):
      source = node.module[len("jaxmem."):] if "." in node.module else ""
      for alias in node.names:
        sub = f"{source}.{alias.name}" if source else alias.name
        if _is_module(sub):  # ``from jaxmem import _flags``: a module
          found.append((sub, None, node.lineno))
        else:
          found.append((source, alias.name, node.lineno))
  return found


def test_every_module_has_a_layer():
  missing = sorted(set(_modules()) - set(RANK))
  assert not missing, f"add these modules to LAYERS in {__file__}: {missing}"


def _upward(name: str, targets) -> list[str]:
  """The jaxmem modules among ``targets`` that ``name`` may not import."""
  return [t for t in targets if t != name and RANK.get(t, -1) >= RANK[name]]


def _cycle(edges: dict) -> list[str] | None:
  """One import cycle of the graph ``edges`` (module -> modules it
  imports), as a path, or None."""
  state: dict = {}

  def visit(node, trail):
    state[node] = "open"
    for nxt in sorted(edges.get(node, ())):
      if state.get(nxt) == "open":
        return trail + [node, nxt]
      if nxt not in state:
        found = visit(nxt, trail + [node])
        if found:
          return found
    state[node] = "done"
    return None

  for name in sorted(edges):
    if name not in state:
      found = visit(name, [])
      if found:
        return found
  return None


def test_imports_run_down_the_layers_only():
  bad = [f"{path.name}:{line} ({name}, layer {RANK[name]}) imports "
         f"{target or 'jaxmem'} (layer {RANK.get(target)})"
         for name, path in _modules().items()
         for target, _, line in _imports(path) if _upward(name, [target])]
  assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_import_cycle():
  edges = {name: {t for t, _, _ in _imports(path) if t != name}
           for name, path in _modules().items()}
  found = _cycle(edges)
  assert found is None, "import cycle: " + " -> ".join(found)


def _later_stage(name: str, targets) -> list[str]:
  """The jaxmem modules among ``targets`` in a stage package after ``name``'s."""
  stage = lambda n: STAGES.index(n.split(".")[0]) if n.split(".")[0] in STAGES else None
  own = stage(name)
  return [] if own is None else [t for t in targets
                                  if stage(t) is not None and stage(t) > own]


def test_stages_run_in_order():
  """The folders show the flow: graph -> schedule -> cost -> planners -> fit."""
  bad = [f"{path.relative_to(PACKAGE)}:{line} imports jaxmem.{target}"
         for name, path in _modules().items()
         for target, _, line in _imports(path) if _later_stage(name, [target])]
  assert not bad, "a stage imports a later stage:\n" + "\n".join(bad)


def test_no_private_name_crosses_modules():
  bad = [f"{path.relative_to(PACKAGE)}:{line} takes {taken!r} from jaxmem.{source}"
         for name, path in _modules().items()
         for source, taken, line in _imports(path)
         if taken is not None and taken.startswith("_") and source != name]
  assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_modules_and_functions_stay_small():
  bad = []
  for path in _modules().values():
    text = path.read_text()
    if len(text.splitlines()) > MAX_MODULE_LINES:
      bad.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
          bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: "
                     f"{length} lines")
  assert not bad, "too long to read at once:\n" + "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
  """The import reader sees what the checks judge (a lazy import, a private
  name, a module import), and the judges catch an upward import and a
  cycle."""
  source = tmp_path / "probe.py"
  source.write_text("def f():\n  from jaxmem.cost._evaluate import _hidden\n"
                    "from jaxmem import _flags\nimport jaxmem.planners\n")
  assert sorted(_imports(source)) == [("_flags", None, 3), ("cost._evaluate", "_hidden", 2),
                                      ("planners", None, 4)]
  assert _upward("cost._evaluate", ["planners", "graph._graph"]) == ["planners"]
  assert _upward("graph._graph", ["graph._graph", "graph._primitives"]) == []
  assert _later_stage("cost._evaluate", ["fit._fit", "graph._graph", "_decisions"]) == [
      "fit._fit"]
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None

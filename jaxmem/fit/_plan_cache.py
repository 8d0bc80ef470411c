"""A persistent cache of plans on disk, so that a restarted run does not
plan again.

Like JAX's compilation cache, an entry is keyed by a digest of everything
that decides the plan: the traced step (:func:`~jaxmem.fit._saved.fingerprint`),
the arguments' shardings, the budget in bytes, the reserve, the target
(its name and profile), the planner and its settings, and the versions of
jaxmem and JAX. A step that changed has another fingerprint, so another
key: a stale entry is never found. An entry is a saved plan
(:mod:`jaxmem.fit._saved`, the format ``Fit.save_plan`` writes), applied like
``transform(..., plan=path)``: compiled once and kept where it fits.

The directory is ``transform(..., plan_cache=dir)``, or where that is not
given the environment variable ``JAXMEM_PLAN_CACHE_DIR``.

Example:
  >>> import tempfile
  >>> from jaxmem._decisions import RECOMPUTE
  >>> from jaxmem.fit._saved import dumps
  >>> where = tempfile.mkdtemp()
  >>> k = key("abc", budget=1000)
  >>> put(where, k, dumps(Plan.of({3: RECOMPUTE}), "abc")) and None
  >>> get(where, k, "abc") == Plan.of({3: RECOMPUTE})
  True
  >>> get(where, key("abc", budget=999), "abc") is None
  True
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from importlib import metadata

import jax

from jaxmem._decisions import Plan
from jaxmem.fit._saved import loads
from jaxmem.targets import Target, timing_profile
from jaxmem.targets._host_args import sharding_texts

ENVIRONMENT = "JAXMEM_PLAN_CACHE_DIR"


def directory(given) -> str | None:
  """The cache directory: ``given`` (a path), else the environment's, else
  None (no cache)."""
  where = os.fspath(given) if given is not None else os.environ.get(ENVIRONMENT)
  return os.path.expanduser(where) if where else None


def _version() -> str:
  try:
    return metadata.version("jaxmem")
  except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
    return "source"


def key(step: str, **decides) -> str:
  """The entry's name for the step of fingerprint ``step`` and what else
  ``decides`` the plan (values rendered with ``repr``), with the versions
  of jaxmem and JAX."""
  record = {"step": step, "jaxmem": _version(), "jax": jax.__version__,
            **{k: repr(v) for k, v in sorted(decides.items())}}
  return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:40]


def entry(given, step: str, leaves, target: Target, planner, **decides
          ) -> tuple[str, str] | None:
  """``(directory, entry)`` of a fit in the cache at ``given``
  (``transform``'s ``plan_cache``; see :func:`directory`), or None where
  there is none: keyed by :func:`key` with the arguments' shardings (of
  ``leaves``), the target's name, timing profile and GPU description, the
  planner's description and the rest of what ``decides`` the plan."""
  where = directory(given)
  if where is None:
    return None
  return where, key(
      step, shardings=list(sharding_texts(leaves)), target=target.name,
      profile=timing_profile(target), planner=planner.describe(),
      description=None if target.profile is None else target.profile.description, **decides)


def path(where: str, name: str) -> str:
  return os.path.join(where, f"{name}.json")


def get(where: str, name: str, step: str) -> Plan | None:
  """The plan cached under ``name``, or None where there is none or the
  entry cannot be read (a warning says which, and the step is planned)."""
  file = path(where, name)
  try:
    with open(file) as f:
      text = f.read()
  except FileNotFoundError:
    return None
  except OSError as err:
    warnings.warn(f"jaxmem: plan cache entry {file} cannot be read ({err}); planning again.")
    return None
  try:
    return loads(text, step, source=file)
  except (ValueError, KeyError, TypeError) as err:
    warnings.warn(f"jaxmem: plan cache entry {file} is not a usable plan ({err}); "
                  "planning again, and the entry is replaced.")
    return None


def put(where: str, name: str, text: str) -> str | None:
  """Writes ``text`` (a saved plan, :func:`~jaxmem.fit._saved.dumps`) under
  ``name`` (atomically: a reader never sees half a file) and returns its
  path; a directory that cannot be written gives a warning, not an error
  (the fit stands)."""
  file = path(where, name)
  try:
    os.makedirs(where, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=where, suffix=".tmp")
    with os.fdopen(handle, "w") as f:
      f.write(text)
    os.replace(temporary, file)
  except OSError as err:
    warnings.warn(f"jaxmem: plan cache directory {where} cannot be written ({err}); "
                  "the plan is used but not cached.")
    return None
  return file

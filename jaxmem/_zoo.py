"""The model zoo, found wherever jaxmem runs from.

Installed, the zoo is the ``jaxmem_models`` package (the top-level
``models/`` folder, under a name that cannot shadow a user's own
``models``). Run from a source tree that is not installed (``PYTHONPATH=.``,
as on a lent GPU machine), the folder beside ``jaxmem/`` is loaded under that
same name, so every caller sees one module.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

NAME = "jaxmem_models"


def models():
  """The ``jaxmem_models`` module.

  Example:
    >>> "gpt2" in models().REGISTRY
    True
  """
  try:
    return importlib.import_module(NAME)
  except ModuleNotFoundError as err:
    if err.name != NAME:
      raise
  folder = pathlib.Path(__file__).resolve().parent.parent / "models"
  spec = importlib.util.spec_from_file_location(
      NAME, folder / "__init__.py", submodule_search_locations=[str(folder)])
  if spec is None:
    raise ModuleNotFoundError(
        f"jaxmem: the model zoo is not installed ({NAME}) and no models/ folder "
        f"is beside {pathlib.Path(__file__).parent}; install jaxmem with "
        "`pip install -e .` from its source tree", name=NAME)
  module = importlib.util.module_from_spec(spec)
  sys.modules[NAME] = module
  spec.loader.exec_module(module)
  return module

"""Test setup for every test path (tests/, the package's doctests, the
guide's): the tests run on the CPU (JAX's CUDA plugin, installed to compile
for GPU targets, would otherwise try to start a GPU backend), and jaxmem
sets the XLA:CPU flag that keeps remat on import, so it is imported before
JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxmem  # noqa: E402,F401  (sets XLA_FLAGS before any computation)

"""Test setup: jaxmem sets the XLA:CPU flag that keeps remat (DESIGN.md
fact 1) on import, so it is imported before JAX starts its backend."""

import os
import sys

import jaxmem  # noqa: F401  (sets XLA_FLAGS before any computation)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: model-scale checks; CI runs a subset")

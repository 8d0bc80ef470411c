"""jaxmem.progress: a long transform's plans and compilations shown as it goes."""

import io
import logging

import jax.numpy as jnp

import jaxmem
from tests.helpers import tanh_step


def _step(w, x):
  return tanh_step(w, x, layers=6, lr=1e-3)


_ARGS = (jnp.eye(64) * 0.1, jnp.ones((512, 64)))


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_a_terminal_gets_one_line_redrawn_and_a_log_a_line_per_event(monkeypatch):
  monkeypatch.setenv("COLUMNS", "300")  # the status is cut to the terminal's width
  log = logging.getLogger("jaxmem")
  level, handlers = log.level, list(log.handlers)
  terminal, file = _Terminal(), io.StringIO()
  with jaxmem.progress(terminal):
    jaxmem.transform(_step, budget="70%").fit(*_ARGS)
  with jaxmem.progress(file) as shown:
    shown.say("a caller's own line")
    fit = jaxmem.transform(_step, budget="70%").fit(*_ARGS)
  assert len(fit.plan)
  # On a terminal: the status redrawn in place, finished by one newline.
  drawn = terminal.getvalue()
  assert drawn.count("\r\x1b[K") >= 2 and drawn.endswith("\n") and drawn.count("\n") == 1
  assert "compiled" in drawn and "best so far" in drawn
  # Elsewhere: a timestamped line per event, the caller's included.
  lines = file.getvalue().splitlines()
  assert lines[0].endswith("a caller's own line") and len(lines) >= 3
  assert all(line.startswith("[") for line in lines) and "\r" not in file.getvalue()
  assert any(" planned for " in line for line in lines)
  # The logger is left as it was.
  assert log.level == level and log.handlers == handlers


def test_warnings_get_a_line_of_their_own():
  terminal = _Terminal()
  with jaxmem.progress(terminal):
    logging.getLogger("jaxmem").info("jaxmem: planning")
    logging.getLogger("jaxmem").warning("jaxmem: this will take long")
  assert terminal.getvalue().endswith("warning: this will take long\n")
  assert "\r\x1b[Kjaxmem 0 s, 0 compiled | planning" in terminal.getvalue()

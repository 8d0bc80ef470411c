"""Progress of long transforms: jaxmem's log shown while it works.

A fit logs each plan and each compilation on the ``jaxmem`` logger at INFO
(:mod:`jaxmem.fit._fit`). :func:`progress` shows those records while a
block runs: on a terminal as one status line redrawn in place (the time so
far, the compilations so far and the latest event), elsewhere (a log file,
CI) as one timestamped line per event. Warnings always get a line of their
own. The library shows nothing unless asked; ``jaxmem-bench`` asks.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from typing import IO, Iterator


class ProgressLine(logging.Handler):
  """A handler that shows ``jaxmem`` records as a status line (see the
  module docstring); :meth:`say` shows a line of the caller's own."""

  def __init__(self, stream: IO[str], live: bool):
    super().__init__(logging.INFO)
    self.stream, self.live = stream, live
    self.began = time.perf_counter()
    self.compiles = 0
    self._drawn = False  # a status line is on the terminal, unfinished

  def emit(self, record: logging.LogRecord) -> None:
    try:
      message = record.getMessage().removeprefix("jaxmem: ")
      if message.startswith("compiled "):
        self.compiles += 1
      if record.levelno >= logging.WARNING:
        self.say(f"{record.levelname.lower()}: {message}")
        return
      status = (f"jaxmem {time.perf_counter() - self.began:.0f} s, "
                f"{self.compiles} compiled | {message}")
      if not self.live:
        self._write(f"[{time.strftime('%H:%M:%S')}] {status}\n")
        return
      width = shutil.get_terminal_size().columns
      self._write("\r\x1b[K" + status[:max(width - 1, 20)])
      self._drawn = True
    except Exception:  # noqa: BLE001 -- logging's contract: never raise
      self.handleError(record)

  def say(self, text: str) -> None:
    """Shows ``text`` on a line of its own, above the status line."""
    self._write(("\r\x1b[K" if self._drawn else "")
                + f"[{time.strftime('%H:%M:%S')}] {text}\n")
    self._drawn = False

  def close(self) -> None:
    if self._drawn:
      self._write("\n")
      self._drawn = False
    super().close()

  def _write(self, text: str) -> None:
    self.stream.write(text)
    self.stream.flush()


@contextlib.contextmanager
def progress(stream: IO[str] | None = None) -> Iterator[ProgressLine]:
  """Shows what jaxmem does while the block runs: each plan and each
  compilation of a fit, with the time so far and the best plan compiled so
  far (see the module docstring). Yields the :class:`ProgressLine`, whose
  ``say(text)`` shows a line of the caller's own beside it.

  Args:
    stream: where to write; standard error by default. On a terminal the
      status is one line redrawn in place, elsewhere a line per event.

  Example:
    >>> import io, jax, jax.numpy as jnp, jaxmem
    >>> out = io.StringIO()
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    >>> with jaxmem.progress(out):
    ...   _ = jaxmem.transform(step, budget="90%").fit(jnp.ones((64, 64)), jnp.ones((128, 64)))
    >>> "compiled the step as written" in out.getvalue()
    True
  """
  stream = sys.stderr if stream is None else stream
  live = bool(getattr(stream, "isatty", lambda: False)())
  line = ProgressLine(stream, live)
  log = logging.getLogger("jaxmem")
  level = log.level
  log.addHandler(line)
  if log.getEffectiveLevel() > logging.INFO:
    log.setLevel(logging.INFO)
  try:
    yield line
  finally:
    log.removeHandler(line)
    log.setLevel(level)
    line.close()

"""Planners: choose a decision per residual so the predicted peak fits.

Every planner is a :class:`Planner` (``plan``, ``lowest``, ``structured``,
``cost``) and is registered by name in :data:`PLANNERS`, so
:func:`jaxmem.transform` and ``jaxmem-bench`` can select it:

* ``recompute``: :class:`Greedy`, recompute only (Libra's greedy);
* ``hybrid``: :class:`Hybrid` (Libra), recompute first, then offload where
  that does not fit, then recomputations switched to offloads that pay;
* ``offload``: :class:`Greedy` with offload moves only;
* ``lgm``: :class:`LGM` (vTensor), chunks swapped to cover each peak;
* ``ilp``: :class:`ILP`, the cheapest combination of per-block policies
  and residuals rebuilt alone, solved exactly (HiGHS, through
  ``scipy.optimize.milp``), with the greedy where no combination fits;
* ``auto``: the same, with the hybrid instead of the greedy on a target
  whose host memory is not the device's;
* ``names``: :class:`Names`, each of the step's ``checkpoint_name``\\ s
  saved, offloaded or rebuilt in every layer;
* ablations ``lgm-whole`` and ``lgm-unreserved``.

Example:
  >>> sorted(PLANNERS)[:3]
  ['auto', 'hybrid', 'ilp']
  >>> get_planner("hybrid").describe()[:16]
  'hybrid on t4 (as'
"""

from __future__ import annotations

from typing import Callable

from jaxmem.planners._base import DEFAULT_TARGET, Planner, with_target
from jaxmem.targets._profiles import get_profile
from jaxmem.planners._fixed import Fixed
from jaxmem.planners._greedy import Greedy
from jaxmem.planners._hybrid import Hybrid
from jaxmem.planners._ilp import ILP, Gap, Solution
from jaxmem.planners._lgm import LGM, LayerReport, SwapRecord, reservation_floor
from jaxmem.planners._names import Names, NoNames


def recompute(target=None, **options) -> Greedy:
  """The recompute-only greedy; with ``target``, plans are costed by
  predicted time on it instead of recomputed FLOPs."""
  return Greedy(target=target, **options)


def hybrid(target=None, swap: str = "greedy", host_budget: int | None = None,
           swaps: int = 32) -> Hybrid:
  """Libra's hybrid for ``target`` (None assumes ``"t4"``, and reports say
  so): the recompute-only greedy, then a greedy with offload moves, or with
  ``swap="lgm"`` the vTensor planner, for what it leaves (see
  :class:`Hybrid`)."""
  if swap not in ("greedy", "lgm"):
    raise ValueError(f"hybrid: swap must be 'greedy' or 'lgm', got {swap!r}")
  target, assumed = with_target(target)
  if swap == "lgm":
    then = LGM(target, host_budget=host_budget, name="hybrid")
  else:
    then = Greedy(name="hybrid", offload=True, target=target, host_budget=host_budget,
                  climbs="none")
  return Hybrid(Greedy(target=target, climbs="blocks"), then, target=target, swaps=swaps,
                host_budget=host_budget, assumed_target=assumed)


def offload_only(target=None, **options) -> Greedy:
  """The greedy with offload moves only (no recomputation) for ``target``
  (None assumes ``"t4"``)."""
  target, assumed = with_target(target)
  return Greedy(name="offload", offload=True, recompute=False, target=target,
                assumed_target=assumed, **options)


def ilp(target=None, **options) -> ILP:
  """The exact per-block planner (:class:`ILP`); with ``target``, plans are
  costed by predicted time on it instead of recomputed FLOPs."""
  return ILP(target=target, **options)


def auto(target=None, **options) -> ILP:
  """The exact planner (:class:`ILP`) with a fallback chosen by the
  target: on one given with a host link (not unified memory), the hybrid,
  so that offload is planned where recomputation does not reach or costs
  more; else the recompute-only greedy."""
  if target is not None and not get_profile(target).unified:
    options.setdefault("fallback", hybrid(target))
  return ILP(target=target, name="auto", **options)


def lgm(target=None, **options) -> LGM:
  """The vTensor planner (:class:`LGM`) for ``target`` (None assumes
  ``"t4"``)."""
  return LGM(target=target, **options)


def lgm_whole(target=None, **options) -> LGM:
  """Ablation: the LGM planner swapping whole tensors only (no vTensors)."""
  return lgm(target, whole=True, name="lgm-whole", **options)


def lgm_unreserved(target=None, **options) -> LGM:
  """Ablation: the LGM planner with memory reservation off (no chunk floor,
  no headroom)."""
  return lgm(target, min_chunk=0, reserve=0.0, name="lgm-unreserved", **options)


def names(target=None, **options) -> Names:
  """The planner over the step's ``checkpoint_name``\\ s (:class:`Names`):
  each name saved, offloaded (with a target that has a host link) or
  rebuilt, every value no name covers rebuilt; its plans are written out as
  a ``jax.checkpoint`` policy by ``Fit.name_policy()``."""
  return Names(target=target, **options)


# Name -> factory taking an optional target (a name in jaxmem.PROFILES or a
# DeviceProfile).
PLANNERS: dict[str, Callable[..., Planner]] = {
    "recompute": recompute, "hybrid": hybrid, "offload": offload_only,
    "lgm": lgm, "ilp": ilp, "auto": auto, "lgm-whole": lgm_whole,
    "lgm-unreserved": lgm_unreserved, "names": names}
# Planners that exist to be compared against (left out of default runs).
ABLATIONS = frozenset({"lgm-whole", "lgm-unreserved"})
# Planners over the values a step names (checkpoint_name), left out of
# default runs: the zoo's models name none.
NAMED = frozenset({"names"})


def get_planner(planner, target=None) -> Planner:
  """A planner from a name in :data:`PLANNERS` (set up for ``target``, a
  profile, where one is given) or a :class:`Planner` (as it is)."""
  if isinstance(planner, str):
    if planner not in PLANNERS:
      raise ValueError(
          f"jaxmem: unknown planner {planner!r}; expected one of {sorted(PLANNERS)} "
          "or a jaxmem.Planner instance.")
    return PLANNERS[planner]() if target is None else PLANNERS[planner](target)
  if not isinstance(planner, Planner):
    raise TypeError(
        f"jaxmem: planner must be a name in {sorted(PLANNERS)} or a jaxmem.Planner "
        f"(subclass it and implement plan(graph, aim, start=None)); got "
        f"{type(planner).__name__}.")
  return planner


__all__ = [
    "ABLATIONS", "DEFAULT_TARGET", "Fixed", "Gap", "Greedy", "Hybrid", "ILP", "LGM", "LayerReport",
    "NAMED", "Names", "NoNames", "PLANNERS", "Planner", "Solution", "SwapRecord", "auto",
    "get_planner", "hybrid", "ilp", "lgm", "lgm_unreserved", "lgm_whole", "names", "offload_only",
    "recompute", "reservation_floor",
]

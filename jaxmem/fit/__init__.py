"""Stage 5, the fit: plans compiled and judged against a budget, and what a
fit decided.

``_fit`` (the fit loop), ``_fitted`` (:class:`Fit` and its report),
``_report``, ``_policies`` (a plan as per-block ``jax.checkpoint`` policies),
``_saved`` and ``_plan_cache`` (plans on disk), ``_arguments`` (static and
donated arguments), ``_batching`` (``jax.vmap`` of a fitted step) and
``_inner`` (steps whose passes run inside a loop). Internal: the public face
is :func:`jaxmem.transform` and :class:`jaxmem.Fit`.
"""

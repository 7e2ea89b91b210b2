"""The report: ``bidir-kv report`` renders a sweep's result; ``demo`` runs a sweep and reports it.

Owns what a reader sees of a result: ``report.md`` with the OFF/ON table, the
planner's prediction and the calibration check, the publication's two plots, and
the headline with the judgement of whether this machine's load lets it stand. Every
number comes from the sweep's data model (:mod:`bidir_kv.bench.summary`) or the
planner (:mod:`bidir_kv.plan.predict`); nothing here measures or fits.

Reading path:

1. ``cli`` — ``bidir-kv report DIR...``: summarize, predict, render.
2. ``markdown`` — ``report.md``; ``plots`` — ``ttft.png`` and ``prefill.png``.
3. ``headline`` — OFF/ON TTFT at the longest prompt and whether it can be trusted.
4. ``demo`` — ``bidir-kv demo``. It lives here because its product is a report: it
   starts a sweep through ``bench``'s command line, then renders this package's
   report and prints the measured lengths beside the planner's prediction and the
   headline. It needs all three products; this package already sits above the other
   two, so ``demo`` adds no import edge (in ``bench`` it would make the sweep import
   its own report).
"""

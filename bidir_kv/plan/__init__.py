"""The planner and cost model: ``bidir-kv plan`` and the emulator profiles it derives.

Owns the per-token cost model of recompute against pull (the same terms the
emulator's profiles evaluate, docs/profiles.md), what it predicts (break-even
threshold, TTFT per prompt length, D's memory under a TTL) and where its numbers
come from: a model shape plus hardware figures, a shipped profile, or a calibration
fitted to a ``bench`` result. It reads the sweep's results (:mod:`bidir_kv.bench`)
and is read by the report (:mod:`bidir_kv.report`).

Reading path:

1. ``planner`` — ``CostModel``, ``Hardware``, break-even, TTFT and TTL rows: pure
   functions calling the rules of :mod:`bidir_kv.policy`.
2. ``modelcfg`` — a model's shape from its ``config.json``; ``derive`` — the shipped
   ``*-p5en`` profiles (``bidir_kv/data/profiles``) computed from shapes and figures.
3. ``calibrate`` (``fit``, ``contention``, ``tail``) — the terms fitted to a
   measured run, the queueing of clients on one P, and the outliers that move a mean;
   ``calprofile`` — a calibration written as an emulator profile.
4. ``predict`` — the cost model's OFF/ON prediction beside a measured sweep.
5. ``decode`` — the decode side: D's running batch beside retained turns (the room a
   TTL may take, the retention budget), a pull's share of D's memory time.
6. ``cli`` — ``bidir-kv plan``.
"""

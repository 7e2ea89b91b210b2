"""The sweep: ``bidir-kv bench`` runs the OFF/ON multi-turn TTFT sweep and writes its result.

Owns everything from the workload to the result directory, and the result's data
model that the planner (:mod:`bidir_kv.plan`) and the report (:mod:`bidir_kv.report`)
read: vLLM's multi-turn benchmark flags and stats field names, one stats JSON and
one metrics delta per leg and point, a manifest. ``bidir-kv bench lease`` (the
renewable lease against the fixed TTL) is a second measurement on the same pieces.

Reading path:

1. ``cli`` — the command line; ``sweep`` runs it: each leg over each point.
2. ``workload`` (``distributions``) — the conversations; ``topo`` — the legs (OFF,
   ON, and ON with another ``--connector``) as topology specs; ``runner``
   (``client``) — one point's requests; ``stats`` — one record per request;
   ``progress``, ``interrupt`` — the console and Ctrl-C.
3. ``overhead`` — the nodes' own CPU and the machine's load per point; ``capacity``
   — whether the client could keep up; ``memory`` — D's KV usage and its
   retained share sampled from ``/metrics`` while a point runs; ``split`` — where each
   point's router log lines are, and the ON reuse turns' prefill split into compute
   and transfer; ``concurrency`` — ``--concurrency``: the sweep once per level of
   concurrent conversations, up to what the topology and the client carry.
4. ``results`` — reading a result directory back; ``summary`` — one row per (leg,
   point) and the OFF/ON ratios, the decode side (TPOT, ITL, D's memory, preemptions)
   and the concurrency sweep's rows, the data model the planner and the report share.
   ``compare`` — with ``--connector stock,bidir-kv``, each connector's ON leg beside
   the reference's: TTFT and P's prefill, median and p90, and their ratios.
5. ``lease`` — ``bench lease``; ``args`` — argparse value types ``plan`` reuses.

Layering: ``plan`` and ``report`` import from here, never the reverse, except that
``cli``'s ``--write-profile`` writes the run's calibration through
:mod:`bidir_kv.plan.calprofile`.
"""

"""Harnesses: micro-benchmarks, a stub engine and a stand-alone transport peer.

They start processes and measure; the runtime packages (``engine``, ``router``,
``policy``, ``protocol``) never import them, so they may use ``topology`` and
``testing`` freely. Each module with a ``main`` runs as ``python -m bidir_kv.tools.<name>``:

* ``transport_bench``: KV transfer bandwidth of our agents and the engine's D→P pull
  against a raw NIXL READ (cases from ``transport_peer`` and ``engine_d2p``);
* ``startup_bench``: launch-to-``/health`` time of ``bidir-kv engine`` per transport;
* ``router_bench``: added latency and throughput of ``bidir-kv proxy`` over stub engines;
* ``transport_peer``: a block owner in its own process, for benches and two-process tests.
"""

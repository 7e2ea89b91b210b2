"""Harnesses: micro-benchmarks, the release gate and a stand-alone transport peer.

Nothing imports them (they sit on top of the layers, below only the command line), so
they may use ``topology`` and ``testing`` freely. Reading path: ``gate`` (the release
gate, docs/hardware.md §6), then the benchmark you need. Each module with a ``main``
runs as ``python -m bidir_kv.tools.<name>``:

* ``gate``: the tiers' results in, one pass/fail and a summary out;
* ``transport_bench``: KV transfer bandwidth of our agents and the engine's D→P pull
  against a raw NIXL READ (cases from ``transport_peer`` and ``engine_d2p``);
* ``startup_bench``: launch-to-``/health`` time of ``bidir-kv engine`` per transport;
* ``router_bench``: added latency and throughput of ``bidir-kv proxy`` over stub engines
  (``bidir_kv.testing.doubles``);
* ``transport_peer``: a block owner in its own process, for benches and two-process tests;
* ``vllm_lease_check``: the renewable lease on real vLLM with our connector.
"""

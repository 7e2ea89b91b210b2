"""Running a node's command: start it, wait for its ``/health``, stop what was started.

Reading path: :mod:`~bidir_kv.launch.process` first: :class:`ManagedProcess` (a child
in its own process group, stopped by recorded PID, never by name), ``ProcessFailed``,
``free_port`` and ``wait_http_ok``, used by every topology backend, the test harness and
the benches. Then :mod:`~bidir_kv.launch.pidfile`: a node that outlives the command that
started it (``bidir-kv serve``), known by its pidfile.

This package builds no command: ``serve`` builds ``vllm serve`` commands and
``topology`` builds ``bidir-kv engine``/``proxy`` ones, and both run them through here,
so it sits below both and imports nothing else of ours. Launchers for other places
(ssh, a batch scheduler, a cluster) belong beside these two.
"""

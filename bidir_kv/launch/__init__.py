"""Running a node's command: start it, wait for its ``/health``, stop what was started.

Reading path: :mod:`~bidir_kv.launch.process` first: :class:`ManagedProcess` (a child
in its own process group, stopped by recorded PID, never by name), ``ProcessFailed``,
``free_port`` and ``wait_http_ok``, used by every topology backend, the test harness and
the benches. Then :mod:`~bidir_kv.launch.pidfile`: a node that outlives the command that
started it (``bidir-kv serve``), known by its pidfile.

Placing a node on another host: :mod:`~bidir_kv.launch.remote` (the ``Command`` a
launcher takes, the handle that stops what it started, ``LaunchFailed``), then
:mod:`~bidir_kv.launch.ssh` (OpenSSH client; pidfile on the host, log fetched back),
:mod:`~bidir_kv.launch.slurm` (one ``srun`` step per role inside a two-node allocation)
and :mod:`~bidir_kv.launch.kubernetes` (one pod per role through the API).

This package builds no command: ``serve`` builds ``vllm serve`` commands and
``topology`` builds ``bidir-kv engine``/``proxy`` ones, and both run them through here,
so it sits below both; it imports only the client (readiness over HTTP) and errors.
"""

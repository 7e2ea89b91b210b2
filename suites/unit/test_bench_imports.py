"""The sweep, the planner and the report import each other in one direction, without a cycle.

``report`` sits on ``plan`` and ``bench``, ``plan`` on ``bench`` (the data model below
its renderers); ``bench``'s one import of ``plan`` is its command line's
``--write-profile``. Imports inside functions count too.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PRODUCTS = ("bidir_kv.bench", "bidir_kv.plan", "bidir_kv.report")
# bench -> plan: `bidir-kv bench --write-profile` writes the run's calibration
UPWARD = {("bidir_kv.bench.cli", "bidir_kv.plan.calprofile"),
          ("bidir_kv.bench.cli", "bidir_kv.plan.planner")}  # fmt: skip


def product_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PRODUCTS:
        init = importlib.import_module(pkg).__file__
        assert init is not None
        files = Path(init).parent.glob("*.py")
        mods |= {f"{pkg}.{f.stem}": f for f in files if f.stem != "__init__"}
    return mods


def product_imports() -> dict[str, set[str]]:
    """``module -> product modules it imports``, counting imports inside functions too."""
    mods = product_modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            deps |= {d for d in found if d in mods and d != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for dep in sorted(graph[node]):
            cycle = visit(dep, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return None


def level(module: str) -> int:
    return next(i for i, pkg in enumerate(PRODUCTS) if module.startswith(pkg + "."))


def test_product_import_graph_is_acyclic() -> None:
    assert find_cycle(product_imports()) is None


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    graph = product_imports()
    graph["bidir_kv.bench.summary"] = {*graph["bidir_kv.bench.summary"], "bidir_kv.report.markdown"}
    cycle = find_cycle(graph)
    assert cycle is not None and "bidir_kv.report.markdown" in cycle


def test_each_product_imports_only_the_ones_below_it() -> None:
    upward = {(mod, dep) for mod, deps in product_imports().items() for dep in deps
              if level(dep) > level(mod)}  # fmt: skip
    assert upward == UPWARD


def test_renderers_sit_above_the_data_model() -> None:
    graph = product_imports()
    for model in ("bench.summary", "bench.results", "plan.predict", "plan.calibrate"):
        renderers = {d for d in graph[f"bidir_kv.{model}"] if d.startswith("bidir_kv.report.")}
        assert not renderers, model

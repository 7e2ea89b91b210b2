"""The mutation score of a ``mutmut run``, per covered package, with a floor.

``mutmut`` leaves one ``<file>.meta`` per mutated file under ``mutants/``: every
mutant's name and the exit code its tests gave (1: a test failed, the mutant is
killed; 0: every test passed, it survived; 33 or 5: no test reaches it; ``null``:
not run). This reads them, leaves out the mutants named in the equivalents file
(a mutant that changes no behaviour cannot be killed: each is listed there with
why), and writes ``score.json`` and ``survivors.md`` (the survivors with their
diffs) to the output directory. The exit status is 1 when a package's score is
below its floor, 2 when nothing was run, so the nightly job fails.

    python -m bidir_kv.tools.mutation_score --floor 0.80 --scope bidir_kv.policy
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PackageScore", "load_equivalents", "main", "read_results", "score"]

KILLED_CODES = {1, 3, 36, 37, 24, -24, 152, 255, -9, -11}  # failed, timed out, type check
SURVIVED_CODES = {0}
NO_TESTS_CODES = {5, 33}


@dataclass
class PackageScore:
    """One package's mutants by outcome; ``score`` = killed / (killed + survived + no tests)."""

    package: str
    killed: int = 0
    survived: list[str] = field(default_factory=list)
    no_tests: list[str] = field(default_factory=list)
    equivalent: list[str] = field(default_factory=list)
    not_run: int = 0

    @property
    def judged(self) -> int:
        return self.killed + len(self.survived) + len(self.no_tests)

    @property
    def score(self) -> float | None:
        return self.killed / self.judged if self.judged else None

    def to_dict(self) -> dict[str, object]:
        return {
            "package": self.package,
            "score": self.score,
            "killed": self.killed,
            "survived": len(self.survived),
            "no_tests": len(self.no_tests),
            "equivalent": len(self.equivalent),
            "not_run": self.not_run,
        }


def read_results(mutants: Path) -> dict[str, int | None]:
    """Every mutant's name -> its exit code (``None``: not run), from ``mutants/**.meta``."""
    out: dict[str, int | None] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        out.update(json.loads(meta.read_text()).get("exit_code_by_key") or {})
    return out


def load_equivalents(path: Path | None) -> dict[str, str]:
    """``name  reason`` lines (``#`` comments): mutants that change no behaviour."""
    if path is None or not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        out[name] = reason.strip()
    return out


def _package_of(name: str, scopes: Sequence[str]) -> str | None:
    """The longest scope ``name`` lies in (a mutant is ``module.x_function__mutmut_N``)."""
    hits = [s for s in scopes if name == s or name.startswith(s + ".")]
    return max(hits, key=len) if hits else None


def score(
    results: dict[str, int | None], scopes: Sequence[str], equivalents: Iterable[str] = ()
) -> dict[str, PackageScore]:
    eq = set(equivalents)
    out = {s: PackageScore(s) for s in scopes}
    for name, code in sorted(results.items()):
        pkg = _package_of(name, scopes)
        if pkg is None:
            continue
        row = out[pkg]
        if code is None:
            row.not_run += 1
        elif name in eq:
            row.equivalent.append(name)
        elif code in KILLED_CODES:
            row.killed += 1
        elif code in SURVIVED_CODES:
            row.survived.append(name)
        elif code in NO_TESTS_CODES:
            row.no_tests.append(name)
        else:  # suspicious, interrupted, skipped: not a kill
            row.survived.append(name)
    return out


def _diff(name: str, mutmut: str) -> str:
    try:
        done = subprocess.run(
            [mutmut, "show", name], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(no diff: {exc})"
    return done.stdout.strip() or done.stderr.strip()


def _report(
    rows: dict[str, PackageScore],
    equivalents: dict[str, str],
    floors: dict[str, float],
    mutmut: str | None,
) -> str:
    lines = [
        "# Mutation testing: survivors",
        "",
        "| package | score | floor | killed | survived | no tests | equivalent | not run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        s = "-" if r.score is None else f"{r.score:.1%}"
        lines.append(
            f"| {r.package} | {s} | {floors.get(r.package, 0.0):.0%} | {r.killed} | "
            f"{len(r.survived)} | {len(r.no_tests)} | {len(r.equivalent)} | "
            f"{r.not_run} |"
        )
    for r in rows.values():
        for title, names in (("survived", r.survived), ("no test reaches it", r.no_tests)):
            for name in names:
                lines += ["", f"## {name} ({title})", ""]
                if mutmut is not None:
                    lines += ["```diff", _diff(name, mutmut), "```"]
        for name in r.equivalent:
            lines += ["", f"## {name} (equivalent)", "", equivalents[name]]
    return "\n".join(lines) + "\n"


def _floors(items: Sequence[str], default: float, scopes: Sequence[str]) -> dict[str, float]:
    out = dict.fromkeys(scopes, default)
    for item in items:
        pkg, sep, value = item.partition("=")
        if not sep or pkg not in out:
            raise SystemExit(f"--package-floor {item!r}: expected one of --scope's names=SHARE")
        out[pkg] = float(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mutation_score", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", type=Path, default=Path("mutants"))
    ap.add_argument(
        "--scope",
        action="append",
        required=True,
        help="a covered package or module (dotted), once per package",
    )
    ap.add_argument("--floor", type=float, default=0.0, help="the least score of every scope")
    ap.add_argument("--package-floor", action="append", default=[], metavar="SCOPE=SHARE")
    ap.add_argument("--equivalents", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("out/mutation"))
    ap.add_argument("--mutmut", default=None, help="the mutmut command, for survivors' diffs")
    args = ap.parse_args(argv)
    equivalents = load_equivalents(args.equivalents)
    rows = score(read_results(args.mutants), args.scope, equivalents)
    floors = _floors(args.package_floor, args.floor, args.scope)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "score.json").write_text(
        json.dumps({"floors": floors, "packages": [r.to_dict() for r in rows.values()]}, indent=1)
    )
    (args.out / "survivors.md").write_text(_report(rows, equivalents, floors, args.mutmut))
    status = 0
    for r in rows.values():
        if r.score is None:
            print(f"mutation: {r.package}: no mutant was run", file=sys.stderr)
            status = max(status, 2)
            continue
        verdict = "ok" if r.score >= floors[r.package] else "BELOW THE FLOOR"
        print(
            f"mutation: {r.package}: {r.score:.1%} ({r.killed} killed, {len(r.survived)} "
            f"survived, {len(r.no_tests)} untested, {len(r.equivalent)} equivalent; "
            f"floor {floors[r.package]:.0%}) {verdict}"
        )
        if r.score < floors[r.package]:
            status = max(status, 1)
    return status


if __name__ == "__main__":
    raise SystemExit(main())

"""The mutation score of a ``mutmut run``, per covered package, with a floor.

``mutmut`` leaves one ``<file>.meta`` per mutated file under ``mutants/``: every
mutant's name and the exit code its tests gave (1: a test failed, the mutant is
killed; 0: every test passed, it survived; 33 or 5: no test reaches it; ``null``:
not run). This reads them, leaves out the mutants named in the equivalents file
(a mutant that changes no behaviour cannot be killed: each is listed there with
why), and writes ``score.json`` and ``survivors.md`` (the survivors with their
diffs) to the output directory. The exit status is 1 when a package's score is
below its floor, 2 when nothing was run, so the nightly job fails.

With ``--doc`` it also rewrites the "suite power" table of a Markdown page (the rows
between :data:`TABLE_BEGIN` and :data:`TABLE_END`, docs/conformance.md): one row per
scope with its mutants, outcomes, score, floor and when it was last run. A scope this run
did not measure keeps its row as it was, so a run of some scopes never erases the others.

    python -m bidir_kv.tools.mutation_score --floor 0.80 --scope bidir_kv.policy \
        --doc docs/conformance.md --run-label "2026-12-04 abc1234"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

__all__ = [
    "TABLE_BEGIN",
    "TABLE_END",
    "TABLE_HEADER",
    "PackageScore",
    "PowerRow",
    "load_equivalents",
    "main",
    "parse_table",
    "read_results",
    "render_table",
    "score",
    "update_doc",
]

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


# ---- the "suite power" table of docs/conformance.md ------------------------------------

TABLE_BEGIN = (
    "<!-- suite-power: begin (written by python -m bidir_kv.tools.mutation_score --doc) -->"
)
TABLE_END = "<!-- suite-power: end -->"
TABLE_HEADER = (
    "| scope | mutants | killed | equivalent | survived | untested | not run | score | floor "
    "| last run |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
)


@dataclass(frozen=True)
class PowerRow:
    """One scope's row: counts from its last run, its score and floor, that run's label."""

    scope: str
    mutants: int
    killed: int
    equivalent: int
    survived: int
    untested: int
    not_run: int
    score: float | None
    floor: float
    last_run: str

    @classmethod
    def of(cls, pkg: PackageScore, floor: float, last_run: str) -> PowerRow:
        return cls(
            scope=pkg.package,
            mutants=pkg.judged + len(pkg.equivalent) + pkg.not_run,
            killed=pkg.killed,
            equivalent=len(pkg.equivalent),
            survived=len(pkg.survived),
            untested=len(pkg.no_tests),
            not_run=pkg.not_run,
            score=pkg.score,
            floor=floor,
            last_run=last_run,
        )

    def render(self) -> str:
        score = "-" if self.score is None else f"{self.score:.1%}"
        cells = (
            f"`{self.scope}`",
            str(self.mutants),
            str(self.killed),
            str(self.equivalent),
            str(self.survived),
            str(self.untested),
            str(self.not_run),
            score,
            f"{self.floor:.0%}",
            self.last_run,
        )
        return "| " + " | ".join(cells) + " |"

    @classmethod
    def parse(cls, line: str) -> PowerRow:
        """The inverse of :meth:`render`; ``ValueError`` naming the line otherwise."""
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not (cells[0].startswith("`") and cells[0].endswith("`")):
            raise ValueError(f"not a suite power row (10 cells, a `scope` first): {line!r}")
        try:
            counts = [int(c) for c in cells[1:7]]
            score = None if cells[7] == "-" else float(cells[7].removesuffix("%")) / 100
            floor = float(cells[8].removesuffix("%")) / 100
        except ValueError:
            raise ValueError(f"not a suite power row (counts, score, floor): {line!r}") from None
        mutants, killed, equivalent, survived, untested, not_run = counts
        return cls(
            cells[0].strip("`"),
            mutants,
            killed,
            equivalent,
            survived,
            untested,
            not_run,
            score,
            floor,
            cells[9],
        )


def render_table(rows: Iterable[PowerRow]) -> str:
    """The table, one row per scope in the order given, between its markers."""
    return "\n".join([TABLE_BEGIN, *TABLE_HEADER, *(r.render() for r in rows), TABLE_END])


def _table_span(text: str) -> tuple[int, int]:
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no suite power table: the page needs {TABLE_BEGIN!r} and {TABLE_END!r}")
    return begin, end + len(TABLE_END)


def parse_table(text: str) -> list[PowerRow]:
    """The rows of the table in ``text`` (a whole page); ``ValueError`` when the table is
    missing, its header differs from :data:`TABLE_HEADER` or a row does not parse."""
    begin, end = _table_span(text)
    lines = text[begin:end].splitlines()[1:-1]
    if tuple(lines[:2]) != TABLE_HEADER:
        raise ValueError(f"the suite power table's header is not {TABLE_HEADER[0]!r}")
    return [PowerRow.parse(line) for line in lines[2:]]


def update_doc(path: Path, measured: Sequence[PowerRow], order: Sequence[str] = ()) -> None:
    """Replace the rows of the scopes ``measured``, keep the others; rows in ``order``
    first (the scopes of ``ci/mutation.sh``), then any other row the page had."""
    text = path.read_text(encoding="utf-8")
    rows = {r.scope: r for r in parse_table(text)}
    rows.update({r.scope: r for r in measured})
    ordered = [rows.pop(s) for s in order if s in rows] + list(rows.values())
    begin, end = _table_span(text)
    path.write_text(text[:begin] + render_table(ordered) + text[end:], encoding="utf-8")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mutation_score", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", type=Path, default=Path("mutants"))
    ap.add_argument(
        "--scope",
        action="append",
        default=[],
        help="a covered package or module (dotted), once per package",
    )
    ap.add_argument("--floor", type=float, default=0.0, help="the least score of every scope")
    ap.add_argument("--package-floor", action="append", default=[], metavar="SCOPE=SHARE")
    ap.add_argument("--equivalents", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("out/mutation"))
    ap.add_argument("--mutmut", default=None, help="the mutmut command, for survivors' diffs")
    ap.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="a Markdown page whose suite power table gets this run's rows",
    )
    ap.add_argument(
        "--run-label",
        default=None,
        help="the 'last run' cell of this run's rows (default: today's UTC date)",
    )
    ap.add_argument(
        "--order",
        default="",
        help="space-separated scopes: the table's row order (default: as the page has them)",
    )
    ap.add_argument(
        "--from-score",
        action="append",
        type=Path,
        default=[],
        metavar="SCORE_JSON",
        help="instead of reading mutants/: the rows of other runs' score.json (the nightly "
        "job's parts), put in --doc and judged against the floors they were run with",
    )
    return ap


def _verdicts(rows: Iterable[PowerRow]) -> int:
    """Print one line per row; 1 when a row is under its floor."""
    status = 0
    for r in rows:
        assert r.score is not None
        verdict = "ok" if r.score >= r.floor else "BELOW THE FLOOR"
        print(
            f"mutation: {r.scope}: {r.score:.1%} ({r.killed} killed, {r.survived} survived, "
            f"{r.untested} untested, {r.equivalent} equivalent, {r.not_run} not run; "
            f"floor {r.floor:.0%}) {verdict}"
        )
        if r.score < r.floor:
            status = 1
    return status


def _merge(args: argparse.Namespace) -> int:
    rows: list[PowerRow] = []
    for path in args.from_score:
        try:
            rows += [PowerRow(**row) for row in json.loads(path.read_text())["rows"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"mutation: {path}: not a score.json of this tool ({exc})", file=sys.stderr)
            return 2
    if not rows:
        print("mutation: the score files hold no measured scope", file=sys.stderr)
        return 2
    if args.doc is not None:
        update_doc(args.doc, rows, args.order.split())
    return _verdicts(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.from_score:
        return _merge(args)
    if not args.scope:
        ap.error("give --scope (one per covered package) or --from-score")
    equivalents = load_equivalents(args.equivalents)
    rows = score(read_results(args.mutants), args.scope, equivalents)
    floors = _floors(args.package_floor, args.floor, args.scope)
    label = args.run_label or datetime.now(UTC).strftime("%Y-%m-%d")
    power = [PowerRow.of(r, floors[r.package], label) for r in rows.values() if r.score is not None]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "score.json").write_text(
        json.dumps(
            {
                "floors": floors,
                "run_label": label,
                "packages": [r.to_dict() for r in rows.values()],
                "rows": [dataclasses.asdict(p) for p in power],
            },
            indent=1,
        )
    )
    (args.out / "survivors.md").write_text(_report(rows, equivalents, floors, args.mutmut))
    if args.doc is not None:
        update_doc(args.doc, power, args.order.split())
    status = _verdicts(power)
    for r in rows.values():
        if r.score is None:
            print(f"mutation: {r.package}: no mutant was run", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    raise SystemExit(main())

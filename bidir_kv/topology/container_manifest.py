"""The base layer of the project's container image: which host files go into it.

No image can be pulled on our CI machines (docs/containers.md §3), so the base layer
is assembled from the host: the interpreter the project venv runs on (binary,
``libpython``, the standard library without tests/GUI), every shared library ``ldd``
reports for it and for the extension modules, and the installed distributions
``bidir-kv`` needs at runtime (its requirement closure from the venv's metadata).
Files keep their host paths inside the image (the interpreter finds its prefix from
its own location); :data:`IMAGE_PYTHON` links to it.

:mod:`bidir_kv.topology.container_image` imports the tar this module writes and
builds the app layer on top.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

from bidir_kv.topology.base import BackendUnavailable

__all__ = [
    "IMAGE_PYTHON",
    "base_fingerprint",
    "base_manifest",
    "host_python",
    "link_chain",
    "runtime_distributions",
    "stdlib_files",
    "write_base_tar",
]

IMAGE_PYTHON = "/usr/local/bin/python3"
_FORMAT = "2"  # bump when the base layout changes, so old cached images are not reused

# stdlib parts a headless server never imports
_STDLIB_SKIP_TOP = {
    "site-packages",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
}
_STDLIB_SKIP_ANY = {"test", "tests", "idle_test"}
# extension modules for GUIs, terminals and CPython's own tests (they drag in X11, ncurses)
_DYNLOAD_SKIP = ("_tkinter", "_curses", "_ctypes_test", "_test", "xx", "_xx", "readline")
_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def runtime_distributions(
    root: str = "bidir-kv", extras: Iterable[str] = ()
) -> list[metadata.Distribution]:
    """The installed distributions ``root`` needs at runtime (requirement closure).

    Markers are evaluated for this interpreter; ``extras`` names optional
    distributions to add (with their own closures) when they are installed.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, metadata.Distribution] = {}
    todo = [root, *extras]
    optional = set(map(canonicalize_name, extras))
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name in optional:
                continue
            raise BackendUnavailable(
                f"cannot build the container image: {name!r} (needed by {root}) is not "
                f"installed in {sys.prefix}"
            ) from None
        seen[name] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    seen.pop(canonicalize_name(root), None)  # the project itself goes into the app layer
    return sorted(seen.values(), key=lambda d: str(d.metadata["Name"]).lower())


def host_python() -> tuple[Path, Path]:
    """The venv's base interpreter binary and its standard-library directory."""
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_path("stdlib"))
    if not (stdlib / "os.py").exists():
        raise BackendUnavailable(f"cannot locate the standard library of {exe} (tried {stdlib})")
    return exe, stdlib


def stdlib_files(stdlib: Path) -> Iterator[Path]:
    """The standard library a headless server imports (no tests, GUI or pip bootstrap)."""
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel = Path(dirpath).relative_to(stdlib)
        if rel == Path("."):
            dirnames[:] = [
                d for d in dirnames if d not in _STDLIB_SKIP_TOP and not d.startswith("config-")
            ]
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_ANY]
        for f in filenames:
            if _skip_file(f) or (rel.name == "lib-dynload" and f.startswith(_DYNLOAD_SKIP)):
                continue
            yield Path(dirpath) / f


def _skip_file(name: str) -> bool:
    """Optimised-bytecode variants (only used under ``python -O``)."""
    return name.endswith((".opt-1.pyc", ".opt-2.pyc"))


def _dist_files(dist: metadata.Distribution, site: Path) -> Iterator[tuple[Path, Path]]:
    """(host path, path relative to site-packages) for every file a distribution owns.

    Skips files outside site-packages (console scripts), test folders and
    optimised bytecode.
    """
    for f in dist.files or ():
        rel = Path(os.path.normpath(f))
        if rel.parts[0] == ".." or _skip_file(rel.name) or _STDLIB_SKIP_ANY & set(rel.parts):
            continue
        host = site / rel
        if host.is_file():
            yield host, rel


def _shared_libraries(binaries: list[Path]) -> set[Path]:
    """Every library (and the loader) ``ldd`` reports for ``binaries``."""
    libs: set[Path] = set()
    for start in range(0, len(binaries), 200):
        chunk = [str(b) for b in binaries[start : start + 200]]
        out = subprocess.run(["ldd", *chunk], capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            m = _LDD_LINE.search(line)
            if m:
                libs.add(Path(m.group(1)))
    return libs


def link_chain(path: Path) -> list[tuple[Path, str | None]]:
    """``path`` with directory symlinks resolved, then each file symlink hop to the real file.

    Returns (path, link target or None) so the image holds the same links as the host
    (``/lib64/ld-linux-x86-64.so.2`` -> ``/usr/lib64/...`` -> the real loader).
    """
    out: list[tuple[Path, str | None]] = []
    current = path
    for _ in range(16):
        current = Path(os.path.realpath(current.parent)) / current.name
        if current.is_symlink():
            target = os.readlink(current)
            out.append((current, target))
            current = current.parent / target
        else:
            out.append((current, None))
            return out
    raise BackendUnavailable(f"symlink loop while collecting {path}")


_EXTRAS = ("redis",)  # optional at runtime (the router's shared store); added when installed


def base_fingerprint() -> str:
    """Cheap identity of the base layer: interpreter, stdlib folders, distribution versions.

    Computed every session (about 0.3 s); the full file manifest is only walked
    when this says the layer must be built. Each distribution's ``RECORD`` (file
    hashes written by pip) is part of it, so a changed venv gets a new base.
    """
    exe, stdlib = host_python()
    digest = hashlib.sha256(f"{_FORMAT}|{sys.version}|{exe}|{exe.stat().st_mtime_ns}".encode())
    for d in (stdlib, stdlib / "lib-dynload"):
        digest.update(f"|{d}|{d.stat().st_mtime_ns}".encode())
    for dist in runtime_distributions(extras=_EXTRAS):
        digest.update(f"|{dist.metadata['Name']}=={dist.version}|".encode())
        digest.update((dist.read_text("RECORD") or "").encode())
    return digest.hexdigest()[:16]


def base_manifest() -> tuple[list[tuple[str, Path]], list[tuple[str, str]]]:
    """Files (arcname, host path) and symlinks (arcname, target) of the base layer."""
    exe, stdlib = host_python()
    site_dst = stdlib / "site-packages"
    venv_site = Path(sysconfig.get_path("purelib"))
    files: dict[str, Path] = {}
    links: dict[str, str] = {}

    for p in stdlib_files(stdlib):
        if p.is_symlink():
            links[str(p)] = os.readlink(p)
        else:
            files[str(p)] = p
    for dist in runtime_distributions(extras=_EXTRAS):
        for host, rel in _dist_files(dist, venv_site):
            files[str(site_dst / rel)] = host
    binaries = [exe] + [h for h in files.values() if h.name.endswith(".so")]
    venv_real = venv_site.resolve()
    for lib in sorted({exe, *_shared_libraries(binaries)}):
        if lib.resolve().is_relative_to(venv_real):
            continue  # bundled wheel libraries (numpy.libs, ...) come with their distribution
        for path, target in link_chain(lib):
            if target is None:
                files.setdefault(str(path), path)
            else:
                links[str(path)] = target
    links[IMAGE_PYTHON] = str(exe)
    return sorted(files.items()), sorted(links.items())


def _dir_entry(name: str, mode: int = 0o755) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    return info


def _link_entry(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


def write_base_tar(path: Path, files: list[tuple[str, Path]], links: list[tuple[str, str]]) -> None:
    """The base layer as a tar for ``docker import``: a root skeleton, files, symlinks."""
    with tarfile.open(path, "w") as tar:
        # Debian's merged-/usr skeleton (docs/containers.md §3.1)
        for d in (
            "etc",
            "proc",
            "sys",
            "dev",
            "root",
            "usr",
            "usr/bin",
            "usr/lib",
            "usr/lib64",
            "usr/sbin",
            "usr/local",
            "usr/local/bin",
            "app",
        ):
            tar.addfile(_dir_entry(d))
        tar.addfile(_dir_entry("tmp", 0o1777))
        for name in ("bin", "lib", "lib64", "sbin"):
            tar.addfile(_link_entry(name, f"usr/{name}"))
        for arc, host in files:
            tar.add(str(host), arcname=arc.lstrip("/"), recursive=False)
        for arc, target in links:
            tar.addfile(_link_entry(arc.lstrip("/"), target))

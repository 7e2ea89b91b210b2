"""A registry-less Docker image of this project, built from the host's own Python.

No image can be pulled on our CI machines (containers.md §3), so the image is
assembled from files already on the host, in two cached layers:

* **base** (``bidir-kv-base:<hash>``): the interpreter the project venv runs on
  (binary, ``libpython``, the standard library without tests/GUI), every shared
  library ``ldd`` reports for it and for the extension modules, and the
  installed distributions ``bidir-kv`` needs at runtime (its requirement closure
  from the venv's metadata). Packed with :mod:`tarfile` and ``docker import``-ed.
  The hash covers every file's path, size and mtime, so it is rebuilt only when
  the interpreter or the venv changes.
* **app** (``bidir-kv:<hash>``): ``FROM`` the base, ``COPY`` of ``bidir_kv/``
  and ``fixtures/`` to ``/app``. The hash covers their contents, so an edit to
  the package rebuilds only this small layer.

Files keep their host paths inside the image (the interpreter finds its prefix
from its own location); ``/usr/local/bin/python3`` links to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bidir_kv.topology.base import BackendUnavailable

__all__ = ["IMAGE_PYTHON", "PROJECT_ROOT", "ImageBuild", "ensure_image", "runtime_distributions"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
IMAGE_PYTHON = "/usr/local/bin/python3"
BASE_REPO = "bidir-kv-base"
APP_REPO = "bidir-kv"
LABEL = "org.bidir-kv.image"
_FORMAT = "2"  # bump when the base layout changes, so old cached images are not reused
_APP_FORMAT = "2"  # same for the app layer's Dockerfile
PRUNE_AFTER_SECONDS = 6 * 3600.0

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


@dataclass(frozen=True)
class ImageBuild:
    """What :func:`ensure_image` produced, with timings for the report."""

    tag: str
    base_tag: str
    base_built: bool
    app_built: bool
    base_seconds: float
    app_seconds: float
    size_bytes: int


# ---- what goes into the base layer ----------------------------------------------


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


def _host_python() -> tuple[Path, Path]:
    """The venv's base interpreter binary and its standard-library directory."""
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_path("stdlib"))
    if not (stdlib / "os.py").exists():
        raise BackendUnavailable(f"cannot locate the standard library of {exe} (tried {stdlib})")
    return exe, stdlib


def _stdlib_files(stdlib: Path) -> Iterator[Path]:
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


def _link_chain(path: Path) -> list[tuple[Path, str | None]]:
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


# ---- building -----------------------------------------------------------------


def _docker_client() -> Any:
    try:
        import docker
    except ImportError as exc:
        raise BackendUnavailable(f"the docker Python SDK is not installed ({exc})") from None
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:  # docker raises several unrelated types for "no daemon"
        raise BackendUnavailable(
            f"no Docker engine reachable ({exc}); run ci/provision.d/docker.sh as root"
        ) from None
    return client


def _image_exists(client: Any, tag: str) -> bool:
    import docker.errors

    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


_EXTRAS = ("redis",)  # optional at runtime (the router's shared store); added when installed


def _base_fingerprint() -> str:
    """Cheap identity of the base layer: interpreter, stdlib folders, distribution versions.

    Computed every session (about 0.3 s); the full file manifest is only walked
    when this says the layer must be built. Each distribution's ``RECORD`` (file
    hashes written by pip) is part of it, so a changed venv gets a new base.
    """
    exe, stdlib = _host_python()
    digest = hashlib.sha256(f"{_FORMAT}|{sys.version}|{exe}|{exe.stat().st_mtime_ns}".encode())
    for d in (stdlib, stdlib / "lib-dynload"):
        digest.update(f"|{d}|{d.stat().st_mtime_ns}".encode())
    for dist in runtime_distributions(extras=_EXTRAS):
        digest.update(f"|{dist.metadata['Name']}=={dist.version}|".encode())
        digest.update((dist.read_text("RECORD") or "").encode())
    return digest.hexdigest()[:16]


def _base_manifest() -> tuple[list[tuple[str, Path]], list[tuple[str, str]]]:
    """Files (arcname, host path) and symlinks (arcname, target) of the base layer."""
    exe, stdlib = _host_python()
    site_dst = stdlib / "site-packages"
    venv_site = Path(sysconfig.get_path("purelib"))
    files: dict[str, Path] = {}
    links: dict[str, str] = {}

    for p in _stdlib_files(stdlib):
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
        for path, target in _link_chain(lib):
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


def _write_base_tar(
    path: Path, files: list[tuple[str, Path]], links: list[tuple[str, str]]
) -> None:
    with tarfile.open(path, "w") as tar:
        # Debian's merged-/usr skeleton (containers.md §3.1)
        for d in ("etc", "proc", "sys", "dev", "root", "usr", "usr/bin", "usr/lib", "usr/lib64",
                  "usr/sbin", "usr/local", "usr/local/bin", "app"):  # fmt: skip
            tar.addfile(_dir_entry(d))
        tar.addfile(_dir_entry("tmp", 0o1777))
        for name in ("bin", "lib", "lib64", "sbin"):
            tar.addfile(_link_entry(name, f"usr/{name}"))
        for arc, host in files:
            tar.add(str(host), arcname=arc.lstrip("/"), recursive=False)
        for arc, target in links:
            tar.addfile(_link_entry(arc.lstrip("/"), target))


def _app_files(root: Path) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for top in ("bidir_kv", "fixtures"):
        base = root / top
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
                out.append((str(p.relative_to(root)), p))
    return out


def _app_context(base_tag: str, files: list[tuple[str, Path]], digest: str) -> io.BytesIO:
    dockerfile = (
        f"FROM {base_tag}\n"
        "COPY app /app\n"
        "WORKDIR /app\n"
        "ENV PYTHONPATH=/app PYTHONUNBUFFERED=1\n"
        # bytecode once at build time instead of in every container start (~0.5 s each)
        f'RUN ["{IMAGE_PYTHON}", "-m", "compileall", "-q", "/app/bidir_kv"]\n'
        f"LABEL {LABEL}=app {LABEL}.source={digest}\n"
    ).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
        for rel, host in files:
            tar.add(str(host), arcname=f"app/{rel}", recursive=False)
    buf.seek(0)
    return buf


@contextlib.contextmanager
def _build_lock(cache: Path) -> Iterator[None]:
    """One builder at a time across processes (pytest-xdist workers, parallel CI steps)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "container-image.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_image(client: Any | None = None, project_root: Path = PROJECT_ROOT) -> ImageBuild:
    """Return the project image, building whichever layer is missing."""
    import docker.errors

    client = client or _docker_client()
    cache = project_root / ".cache"
    with _build_lock(cache):
        base_hash = _base_fingerprint()
        base_tag = f"{BASE_REPO}:{base_hash}"
        base_built, base_seconds = False, 0.0
        if not _image_exists(client, base_tag):
            t0 = time.perf_counter()
            files, links = _base_manifest()
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                tar_path = Path(tmp) / "base.tar"
                _write_base_tar(tar_path, files, links)
                client.api.import_image_from_file(
                    str(tar_path),
                    repository=BASE_REPO,
                    tag=base_hash,
                    changes=[
                        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "ENV LANG=C.UTF-8",
                        "ENV HOME=/root",
                        f'CMD ["{IMAGE_PYTHON}"]',
                        f"LABEL {LABEL}=base",
                    ],
                )
            if not _image_exists(client, base_tag):
                raise BackendUnavailable(f"docker import did not produce {base_tag}")
            base_built, base_seconds = True, time.perf_counter() - t0

        app = _app_files(project_root)
        digest = hashlib.sha256(f"{_APP_FORMAT}|{base_tag}".encode())
        for rel, host in app:
            digest.update(rel.encode() + b"\0" + host.read_bytes() + b"\0")
        app_hash = digest.hexdigest()[:16]
        tag = f"{APP_REPO}:{app_hash}"
        app_built, app_seconds = False, 0.0
        if not _image_exists(client, tag):
            t0 = time.perf_counter()
            try:
                client.images.build(
                    fileobj=_app_context(base_tag, app, app_hash),
                    custom_context=True,
                    tag=tag,
                    rm=True,
                    forcerm=True,
                    pull=False,
                )
            except docker.errors.BuildError as exc:
                lines = [str(x.get("stream", x.get("error", ""))).rstrip() for x in exc.build_log]
                raise BackendUnavailable(
                    f"building {tag} FROM {base_tag} failed: {exc}\n" + "\n".join(lines[-20:])
                ) from None
            app_built, app_seconds = True, time.perf_counter() - t0
            _prune_old(client, keep={tag, base_tag})
        size = int(client.images.get(tag).attrs.get("Size", 0))
    return ImageBuild(tag, base_tag, base_built, app_built, base_seconds, app_seconds, size)


def _prune_old(client: Any, keep: set[str], min_age: float = PRUNE_AFTER_SECONDS) -> None:
    """Drop our tags older than ``min_age`` so edits do not pile up images.

    Only our two repositories are touched, and never a recent tag: another test
    session on the same daemon may still be about to start containers from it
    (its image was current when it began). Images in use by containers are kept
    by Docker itself.
    """
    import docker.errors

    now = time.time()
    for repo in (APP_REPO, BASE_REPO):
        for image in client.images.list(name=repo):
            created = _created_epoch(str(image.attrs.get("Created", "")))
            if created is None or now - created < min_age:
                continue
            for t in image.tags:
                if t.split(":")[0] == repo and t not in keep:
                    with contextlib.suppress(docker.errors.APIError):
                        client.images.remove(t, noprune=False)


def _created_epoch(text: str) -> float | None:
    """Docker's ``Created`` (RFC 3339, nanoseconds) as a Unix time."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", text)
    if m is None:
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp()

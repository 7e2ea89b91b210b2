"""A registry-less Docker image of this project, in two cached layers.

No image can be pulled on our CI machines (docs/containers.md §3), so the image is
built from files already on the host:

* **base** (``bidir-kv-base:<hash>``): the host's interpreter, its libraries and the
  project's runtime distributions (:mod:`bidir_kv.topology.container_manifest`),
  packed with :mod:`tarfile` and ``docker import``-ed. The hash is a fingerprint of
  the interpreter and the venv, so it is rebuilt only when one of them changes.
* **app** (``bidir-kv:<hash>``): ``FROM`` the base, ``COPY`` of ``bidir_kv/``
  and ``fixtures/`` to ``/app``. The hash covers their contents, so an edit to
  the package rebuilds only this small layer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import re
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bidir_kv.paths import REPO_ROOT
from bidir_kv.topology.base import BackendUnavailable
from bidir_kv.topology.container_manifest import (
    IMAGE_PYTHON,
    base_fingerprint,
    base_manifest,
    write_base_tar,
)

__all__ = ["REPO_ROOT", "ImageBuild", "ensure_image"]

BASE_REPO = "bidir-kv-base"
APP_REPO = "bidir-kv"
LABEL = "org.bidir-kv.image"
_APP_FORMAT = "2"  # bump when the app layer's Dockerfile changes (old images not reused)
PRUNE_AFTER_SECONDS = 6 * 3600.0


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


def ensure_image(client: Any | None = None, project_root: Path = REPO_ROOT) -> ImageBuild:
    """Return the project image, building whichever layer is missing."""
    client = client or _docker_client()
    cache = project_root / ".cache"
    with _build_lock(cache):
        base_tag, base_seconds = _ensure_base(client, cache)
        tag, app_seconds = _ensure_app(client, base_tag, project_root)
        size = int(client.images.get(tag).attrs.get("Size", 0))
    return ImageBuild(
        tag,
        base_tag,
        base_seconds is not None,
        app_seconds is not None,
        base_seconds or 0.0,
        app_seconds or 0.0,
        size,
    )


def _ensure_base(client: Any, cache: Path) -> tuple[str, float | None]:
    """The base layer's tag, and how long building it took (``None``: it was cached)."""
    base_hash = base_fingerprint()
    base_tag = f"{BASE_REPO}:{base_hash}"
    if _image_exists(client, base_tag):
        return base_tag, None
    t0 = time.perf_counter()
    files, links = base_manifest()
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tar_path = Path(tmp) / "base.tar"
        write_base_tar(tar_path, files, links)
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
    return base_tag, time.perf_counter() - t0


def _ensure_app(client: Any, base_tag: str, project_root: Path) -> tuple[str, float | None]:
    """The app layer's tag, and how long building it took (``None``: it was cached)."""
    import docker.errors

    app = _app_files(project_root)
    digest = hashlib.sha256(f"{_APP_FORMAT}|{base_tag}".encode())
    for rel, host in app:
        digest.update(rel.encode() + b"\0" + host.read_bytes() + b"\0")
    app_hash = digest.hexdigest()[:16]
    tag = f"{APP_REPO}:{app_hash}"
    if _image_exists(client, tag):
        return tag, None
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
    seconds = time.perf_counter() - t0
    _prune_old(client, keep={tag, base_tag})
    return tag, seconds


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

"""Where converted models live and how kvpass trusts them: the cache folder, sha256 hashes remembered by
(path, size, mtime, inode) in ``<cache>/hashes.json`` (a file is read in full once), an exclusive file lock
per conversion, and the manifest each converted folder carries (``verify`` checks a folder against it).
``kvpass.eval.models`` converts and loads on top of these."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

MANIFEST = "kvpass-manifest.json"
FORMAT = 1


def cache_dir() -> Path:
    """Where converted models live: ``$KVPASS_CACHE`` if set, else ``~/.cache/kvpass``."""
    env = os.environ.get("KVPASS_CACHE")
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "kvpass"


_HASHES = "hashes.json"
_hash_roots: list[Path] = []  # cache roots in use: where remembered hashes are kept


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _hash_db_path() -> Path:
    return (_hash_roots[-1] if _hash_roots else cache_dir()) / _HASHES


def _read_hash_db() -> dict:
    try:
        return json.loads(_hash_db_path().read_text())
    except (OSError, ValueError):
        return {}


def remember(path: Path, sha: str) -> None:
    db_path = _hash_db_path()
    db = {p: e for p, e in _read_hash_db().items() if os.path.exists(p)}
    db[str(path.resolve())] = _stat_key(path) + [sha]
    try:
        db_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".hashes-", dir=db_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(db, f, indent=0)
        os.replace(tmp, db_path)
    except OSError:  # a read-only cache still works, it just hashes again next time
        pass


def sha256(path: Path) -> str:
    """sha256 of a file; read in full only when its (size, mtime, inode) is new."""
    path = Path(path)
    entry = _read_hash_db().get(str(path.resolve()))
    if entry and entry[:3] == _stat_key(path):
        return entry[3]
    sha = hash_file(path)
    remember(path, sha)
    return sha


def hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def using_root(root: Path):
    _hash_roots.append(root)
    try:
        yield
    finally:
        _hash_roots.pop()


@contextlib.contextmanager
def lock(path: Path):
    """An exclusive lock on ``path`` (a no-op where fcntl is missing): one conversion at a time."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except (ImportError, OSError):  # Windows, or a read-only cache (which can still be loaded from)
        f = None
    if f is None:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(folder: Path, source_sha: str | None) -> str | None:
    """None when ``folder`` matches its manifest (and ``source_sha``, if given); else the reason."""
    m = read_manifest(folder)
    if m is None:
        return f"no readable {MANIFEST}"
    if m.get("format") != FORMAT:
        return f"manifest format {m.get('format')} (this kvpass writes {FORMAT})"
    if source_sha is not None and m.get("source", {}).get("sha256") != source_sha:
        return (
            f"the source GGUF changed (sha256 {str(m.get('source', {}).get('sha256'))[:12]}... in the "
            f"manifest, {source_sha[:12]}... now)"
        )
    files = m.get("files") or {}
    if not files:
        return "the manifest lists no files"
    for name, info in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != info["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {info['size']}"
        if sha256(path) != info["sha256"]:
            return f"the sha256 of {name} does not match the manifest"
    return None

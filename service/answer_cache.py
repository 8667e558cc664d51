"""An on-disk cache of ``memfit recommend``'s local answers, so a repeated question is answered in a fraction of a
second instead of the seconds that loading LightGBM, pandas, the terms and the predictor take.

An answer is stored as its JSON (never pickled) under a key that changes whenever anything the answer depends on
changes (:meth:`AnswerCache.key`):

* the request (after the model name or config is resolved);
* the code: every ``*.py`` and ``*.json`` file of ``memfit/``, ``model/``, ``service/``, ``training/`` and ``data/``;
* the shipped data under ``data/`` (terms, architectures, GPU measurements), the model registry's ``CURRENT`` and the
  files of the version it names (files over 1 MiB by size and modification time, the rest by content);
* the telemetry store's contents: each table's row count and largest rowid (SQLite only: with another database
  nothing is cached). An absent database reads as an empty one, so the second run of a fresh checkout hits;
* the versions of Python and of the libraries the answer runs (PyTorch, transformers, PEFT, LightGBM, ...), and the
  ``MEMFIT_*`` settings in the environment.

``MEMFIT_ANSWER_CACHE`` names the folder (default ``$XDG_CACHE_HOME/memfit/answers``, else
``~/.cache/memfit/answers``); ``off`` (or ``0``, or empty) turns the cache off. The newest :data:`MAX_ENTRIES` answers
are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = ("memfit", "model", "service", "training", "data")
#: libraries whose version can change an answer (the predictor, the tracer, the model builders)
LIBRARIES = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "deepspeed",
    "lightgbm",
    "numpy",
    "pandas",
    "scikit-learn",
    "scipy",
    "pydantic",
    "accelerate",
)
BIG_FILE_BYTES = 1 << 20
MAX_ENTRIES = 256
_SKIP_PARTS = frozenset({"__pycache__", "spool", "models"})


def _digest_files(h, files: list[Path], root: Path) -> None:
    for path in sorted(files):
        st = path.stat()
        h.update(f"{path.relative_to(root)}\0{st.st_size}\0".encode())
        if st.st_size > BIG_FILE_BYTES:  # hashing tens of MB would cost as much as answering
            h.update(str(st.st_mtime_ns).encode())
        else:
            h.update(path.read_bytes())


def _tree(root: Path, top: str) -> list[Path]:
    base = root / top
    return [
        p
        for p in base.rglob("*")
        if p.is_file() and not _SKIP_PARTS & set(p.relative_to(base).parts) and not p.name.startswith("telemetry.db")
    ]


def store_rows(db_url: str) -> dict[str, list[int]] | None:
    """``{table: [rows, largest rowid]}`` of the SQLite store at ``db_url`` (empty tables left out; ``{}`` when the
    file does not exist yet); None for a database that is not a SQLite file (nothing is cached then)."""
    if not db_url.startswith("sqlite:///") or db_url == "sqlite:///:memory:":
        return None
    path = Path(db_url.removeprefix("sqlite:///"))
    if not path.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2) as conn:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            out = {}
            for t in sorted(tables):
                try:
                    n, top = conn.execute(f'SELECT count(*), max(rowid) FROM "{t}"').fetchone()
                except sqlite3.OperationalError:  # a WITHOUT ROWID table
                    n, top = conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0], None
                if n:
                    out[t] = [n, top]
            return out
    except sqlite3.Error:
        return None


def library_versions() -> dict[str, str | None]:
    """Python's version and each of :data:`LIBRARIES`' installed version (None when not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": sys.version}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class AnswerCache:
    """Answers (JSON text) by :meth:`key`, one file each under ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def from_env(cls) -> AnswerCache | None:
        """The cache ``MEMFIT_ANSWER_CACHE`` names (see the module docstring); None when it is turned off."""
        where = os.environ.get("MEMFIT_ANSWER_CACHE")
        if where is not None and where.strip().lower() in ("", "0", "off", "false", "no"):
            return None
        if where is None:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            where = os.path.join(base, "memfit", "answers")
        return cls(Path(where))

    def key(self, request_json: str, registry_root: Path, db_url: str) -> str | None:
        """The SHA-256 key of an answer (see the module docstring); None when it cannot be cached (a store that is
        not a SQLite file)."""
        rows = store_rows(db_url)
        if rows is None:
            return None
        h = hashlib.sha256()
        settings = {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("MEMFIT_") and k not in ("MEMFIT_ANSWER_CACHE", "MEMFIT_TOKEN")
        }
        h.update(
            json.dumps(
                {
                    "request": request_json,
                    "store": rows,
                    "versions": library_versions(),
                    "settings": settings,
                    "registry": str(registry_root),
                },
                sort_keys=True,
            ).encode()
        )
        for top in CODE_DIRS:
            _digest_files(h, _tree(REPO, top), REPO)
        registry_root = Path(registry_root)
        current = registry_root / "CURRENT"
        if current.is_file():
            version = current.read_text().strip()
            h.update(f"CURRENT={version}".encode())
            if version and (registry_root / version).is_dir():
                _digest_files(h, [p for p in (registry_root / version).rglob("*") if p.is_file()], registry_root)
        return h.hexdigest()

    def get(self, key: str) -> str | None:
        """The answer stored under ``key``, or None."""
        try:
            return (self.folder / f"{key}.json").read_text()
        except OSError:
            return None

    def put(self, key: str, answer_json: str) -> None:
        """Store an answer (written whole, then renamed into place); keep the newest :data:`MAX_ENTRIES`. A folder
        that cannot be written leaves the answer uncached."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(answer_json)
            tmp.replace(self.folder / f"{key}.json")
            entries = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
            for old in entries[:-MAX_ENTRIES]:
                old.unlink(missing_ok=True)
        except OSError:
            pass

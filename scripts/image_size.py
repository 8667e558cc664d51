"""Size of the service image's Python environment, counted from the installed packages' RECORD files.

Walks the requirement closure of ``memfit[service]`` in the current environment (the versions of
``constraints-dev.txt`` when it was installed by ``scripts/setup.sh``), sums the files each distribution installed,
and splits off what the Dockerfile removes (``tests``/``test`` folders and ``include`` headers) and the app folders it
copies (``data``, ``model``, ``service``, ``training``, ``tracer`` when present). The base image
(``python:3.11-slim``) is not counted: add its own size (``docker image inspect``) for the total.

    python scripts/image_size.py
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
APP_DIRS = ("data", "model", "service", "training", "tracer")
MIB = 1 << 20


def closure(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Distribution names ``name[extras]`` needs, itself included (markers evaluated here)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    names: set[str] = set()

    def walk(dist_name: str, want: frozenset[str]) -> None:
        if (dist_name.lower(), want) in seen:
            return
        seen.add((dist_name.lower(), want))
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            return
        names.add(dist.metadata["Name"])
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None:
                envs = [{"extra": e} for e in want] if "extra" in str(req.marker) else [{"extra": ""}]
                if not any(req.marker.evaluate(env) for env in envs):
                    continue
            walk(req.name, frozenset(req.extras))

    walk(name, extras)
    return names


def removed(path: str) -> bool:
    """Whether the Dockerfile's clean-up deletes this installed file."""
    parts = Path(path).parts
    return any(p in ("tests", "test", "include") for p in parts[:-1])


def main() -> None:
    kept = dropped = 0
    for name in sorted(closure("memfit", frozenset({"service"}))):
        for f in md.distribution(name).files or []:
            try:
                size = os.path.getsize(f.locate())
            except OSError:
                continue
            if removed(str(f)):
                dropped += size
            else:
                kept += size
    app = sum(
        p.stat().st_size
        for d in APP_DIRS
        for p in (ROOT / d).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    print(f"environment kept     {kept / MIB:8.0f} MiB")
    print(f"environment removed  {dropped / MIB:8.0f} MiB (tests, headers)")
    print(f"app folders          {app / MIB:8.0f} MiB")
    print(f"image less its base  {(kept + app) / MIB:8.0f} MiB")


if __name__ == "__main__":
    main()

"""Start-up: make sure the registry has a model that can be served before saying "serving".

:func:`ensure_servable` loads the registry's current model the way the service will
(:meth:`model.registry.Registry.load`: checksums, canary). When the registry is empty or its current
model is broken, it copies the model shipped with memfit (``data/models/CURRENT``, itself loaded and
checksum-verified first) into the registry, promotes it and says so. When neither can serve it raises
:class:`NothingToServe` with both reasons, so the caller refuses to start instead of answering 503.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from model.registry import DEFAULT_ROOT, IncompatibleArtifact, Registry

_LOAD_ERRORS = (FileNotFoundError, IncompatibleArtifact, OSError, ValueError)


class NothingToServe(RuntimeError):
    """Neither the registry nor the shipped model holds a model that loads; the message says why."""


def ensure_servable(registry_dir: str | Path | None, shipped_root: str | Path = DEFAULT_ROOT) -> tuple[str, str]:
    """Return ``(version, note)`` of a current model in ``registry_dir`` that loads.

    ``note`` is one line for the banner: the model is current, or the registry was seeded from the shipped
    model and why. Raises :class:`NothingToServe` naming the registry's and the shipped model's faults."""
    registry, shipped = Registry(registry_dir), Registry(shipped_root)
    try:
        return registry.load().version, f"model {registry.current()} is current"
    except _LOAD_ERRORS as err:
        why = f"{type(err).__name__}: {err}" if not isinstance(err, FileNotFoundError) else "the registry is empty"
    if shipped.root.resolve() == registry.root.resolve():
        raise NothingToServe(f"no model can be served from {registry.root}: {why}")
    try:
        version = shipped.load().version
    except _LOAD_ERRORS as err:
        raise NothingToServe(
            f"no model can be served: {registry.root}: {why}; shipped model {shipped.root}: {type(err).__name__}: {err}"
        ) from err
    try:
        registry.root.mkdir(parents=True, exist_ok=True)
        shutil.copytree(shipped.root / version, registry.root / version, dirs_exist_ok=True)
        registry.promote(version)
        registry.load(version)
    except _LOAD_ERRORS as err:
        raise NothingToServe(
            f"no model can be served from {registry.root}: {why}; seeding it with the shipped "
            f"model {version} failed ({type(err).__name__}: {err})"
        ) from err
    return version, f"seeded the registry with the shipped model {version} (checksum verified): {why}"

"""Catalog of public decoder architectures: ``data/architectures/*.json``, one file per model.

Each file holds ``name`` (lower-case, dash separated), ``aliases`` (e.g. the HF repo id),
``hf_config`` (the published ``config.json`` fields that shape memory), ``published_params``
(the parameter count the authors state or the checkpoint holds) and ``source`` (where both came from).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from data.reduced_moe import REDUCED_MOE
from memfit.errors import UnknownModel, close_names
from memfit.hf import catalog_name_key
from memfit.schema import ModelSpec

ARCH_DIR = Path(__file__).parent / "architectures"


@lru_cache(maxsize=1)
def load_catalog() -> dict[str, dict[str, Any]]:
    """All catalog entries by normalised name and alias."""
    entries: dict[str, dict[str, Any]] = {}
    for path in sorted(ARCH_DIR.glob("*.json")):
        entry = json.loads(path.read_text())
        for key in [entry["name"], *entry.get("aliases", [])]:
            k = catalog_name_key(key)
            if k in entries and entries[k]["name"] != entry["name"]:
                raise ValueError(f"catalog name clash on {key!r} in {path.name}")
            entries[k] = entry
    return entries


def names() -> list[str]:
    """Canonical catalog names, sorted."""
    return sorted({e["name"] for e in load_catalog().values()})


def get(name: str) -> dict[str, Any]:
    """Catalog entry for a name or alias (case-insensitive).

    Raises:
        memfit.errors.UnknownModel: unknown name (a ``KeyError``); the message lists close matches.
    """
    cat = load_catalog()
    k = catalog_name_key(name)
    if k not in cat:
        # names and aliases are matched, each model suggested once by its catalog name
        close = list(dict.fromkeys(cat[c]["name"] for c in close_names(k, cat, n=len(cat))))[:4]
        raise UnknownModel(
            "model",
            "a catalog name or a HF config.json object",
            message=(
                f"unknown model {name[:80]!r}{'...' if len(name) > 80 else ''}; close matches: {', '.join(close) or 'none'}; the catalog's names and aliases: "
                "`memfit models`"
            ),
        )
    return cat[k]


def spec(name_or_config: str | dict[str, Any]) -> ModelSpec:
    """:class:`ModelSpec` for a catalog name or a HF ``config.json`` dict.

    Catalog entries use the published parameter count; a raw config is counted by building the
    model on the ``meta`` device (needs torch + transformers).
    """
    from memfit.hf import model_spec, spec_fields_from_hf_config

    if isinstance(name_or_config, str):
        entry = get(name_or_config)
        fields = spec_fields_from_hf_config(entry["hf_config"])
        n = int(entry["published_params"])
        return ModelSpec(**fields, model_name=entry["name"], total_params=n, trainable_params=n)
    return model_spec(name_or_config)


def hf_config_of(model_name: str | None) -> dict[str, Any] | None:
    """The HF config of a telemetry row's model: the catalog's, else the reduced-width MoE model's the row was
    collected on (:data:`data.reduced_moe.REDUCED_MOE`), else None (a user upload of another model)."""
    if model_name is None:
        return None
    try:
        return get(model_name)["hf_config"]
    except UnknownModel:
        return REDUCED_MOE.get(model_name)

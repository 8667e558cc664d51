"""The shipped snapshot of facts counted on ``meta``-device builds, keyed by each HF config's :func:`config_key`.

``data/parameter_splits.json`` (written by ``scripts/parameter_splits.py`` for every catalog architecture, reduced
MoE model and expert-parallel shard of one; ``tests/test_coefficients.py`` checks sampled entries against meta
builds) holds what a meta build of the model would give: building one imports transformers' model code and takes
4-8 s of a command-line answer on 2 cores. A config outside the snapshot is built once and cached by its readers
(:mod:`model.job`, :mod:`model.deepspeed_zero`).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from model.terms import canonical_config

PARAMETER_SPLITS_PATH = Path(__file__).resolve().parent.parent / "data" / "parameter_splits.json"


def config_key(hf_config: dict[str, Any]) -> str:
    """SHA-256 (hex) of a HF config's canonical form (:func:`model.terms.canonical_config`): one key per model,
    whether the config is given as its published ``config.json`` fields or serialised in full."""
    return hashlib.sha256(json.dumps(canonical_config(hf_config), sort_keys=True).encode()).hexdigest()


@cache
def _snapshot_file() -> dict[str, Any]:
    try:
        return json.loads(PARAMETER_SPLITS_PATH.read_text())
    except FileNotFoundError:
        return {}


def parameter_snapshot(part: str) -> dict[str, Any]:
    """One part of the snapshot by :func:`config_key`: ``splits`` (:func:`model.job.parameter_split`), ``tensors``
    (:func:`model.job.parameter_tensors`), ``params`` (the parameter count of a resolved architecture's spec) or
    ``persistent`` (:func:`model.deepspeed_zero.persistent_parameter_elements`); empty without the file."""
    return _snapshot_file().get(part, {})

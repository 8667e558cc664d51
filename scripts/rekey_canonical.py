"""Map the shipped traced terms and parameter splits to the canonical config key.

The keys of ``data/terms/*.jsonl`` and ``data/parameter_splits.json`` were SHA-256 hashes of the config dict as
given, less a few provenance keys, so a model given as its published ``config.json`` fields and the same model
serialised in full (``memfit.describe()``) had different keys. :func:`model.terms.canonical_config` now keys on
:func:`memfit.hf.canonical_hf_config`. This script:

* recomputes every shipped terms line's key from its model's config (:func:`data.catalog.hf_config_of` of its
  ``model_name``) and its ``training`` fields, and writes the stored key -> new key map
  ``data/terms/canonical_keys.json`` (the lines themselves are left as they are: rewriting them would rewrite
  about 4 MB for 64 characters a line);
* re-keys ``data/parameter_splits.json`` (its values unchanged) and, in place, the small terms files beside the
  tests (``tests/data/terms_*.jsonl``);
* checks that every line and every split is found under its new key, and fails otherwise;
* writes ``memfit/canonical_configs.json``, the canonical configs of the catalog (read without importing
  transformers).

Run it after adding terms keyed by an older memfit, or after changing the transformers pin:

    python scripts/rekey_canonical.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib.metadata import version
from pathlib import Path

from data.catalog import hf_config_of
from memfit.schema import TrainingConfig
from model.snapshot import PARAMETER_SPLITS_PATH, config_key
from model.terms import CANONICAL_KEYS_NAME, SHIPPED_DIR, TermsCache, entry_key, key_training_fields, terms_key

TESTS_DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
#: the keys the pre-canonical key (a hash of the config as given) dropped, to find the old parameter-split keys
_LEGACY_IGNORED = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "architectures",
        "torch_dtype",
        "dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "auto_map",
        "quantization_config",
        "_commit_hash",
        "output_attentions",
        "output_hidden_states",
    }
)


def entry_training(entry: dict) -> TrainingConfig:
    """A training configuration with the key fields of a shipped line (micro-batch and length are not keyed). Without
    sharding the key holds data_parallel_size 1: the ranks the experts are split over stand in for it."""
    fields = key_training_fields(entry["training"])
    if fields.get("sharding", "none") == "none":
        fields["data_parallel_size"] = fields.get("expert_parallel_size", 1)
    return TrainingConfig(micro_batch_size=1, seq_len=512, **fields)


def _legacy_split_key(cfg: dict) -> str:
    body = json.dumps({k: v for k, v in sorted(cfg.items()) if k not in _LEGACY_IGNORED}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def write_canonical_configs() -> int:
    """Write the snapshot of the catalog's and the reduced MoE models' canonical configs; returns its entries."""
    from data import catalog
    from data.reduced_moe import REDUCED_MOE
    from memfit.hf import CANONICAL_CONFIGS_PATH, canonical_snapshot_entry

    configs = [catalog.get(name)["hf_config"] for name in catalog.names()] + list(REDUCED_MOE.values())
    entries = dict(canonical_snapshot_entry(c) for c in configs)
    CANONICAL_CONFIGS_PATH.write_text(
        json.dumps(
            {"transformers_version": version("transformers"), "entries": dict(sorted(entries.items()))}, sort_keys=True
        )
        + "\n"
    )
    return len(entries)


def rekey_terms() -> tuple[int, int]:
    """Write the terms key map; returns (lines, lines whose key changed)."""
    path = SHIPPED_DIR / CANONICAL_KEYS_NAME
    old_map = json.loads(path.read_text())["keys"] if path.is_file() else {}
    keys: dict[str, str] = {}
    lines = 0
    for f in sorted(SHIPPED_DIR.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            e = json.loads(line)
            lines += 1
            cfg = hf_config_of(e["model_name"])
            if cfg is None:
                sys.exit(f"{f.name}: {e['model_name']!r} has no config (not in the catalog nor a reduced MoE model)")
            new = terms_key(cfg, entry_training(e), e["training"].get("cuda_generation"))
            stored = e["key"]
            # a zero2 line moves to the key it shares with fsdp_shard_grad_op (model.terms.training_key_fields)
            if entry_key(e, old_map) not in (stored, new) and e["training"].get("sharding") != "zero2":
                sys.exit(f"{f.name}: {e['model_name']} {stored} maps to neither its stored nor its canonical key")
            if new != stored:
                if keys.get(stored, new) != new:
                    sys.exit(f"{f.name}: {stored} maps to two keys")
                keys[stored] = new
    path.write_text(
        json.dumps({"transformers": version("transformers"), "keys": dict(sorted(keys.items()))}, indent=0) + "\n"
    )
    return lines, len(keys)


def rekey_splits() -> int:
    """Re-key the parameter-split snapshot; returns the entries re-keyed."""
    from data import catalog
    from data.reduced_moe import REDUCED_MOE
    from memfit.hf import local_expert_config, num_routed_experts

    snapshot = json.loads(PARAMETER_SPLITS_PATH.read_text())
    configs = [catalog.get(name)["hf_config"] for name in catalog.names()] + list(REDUCED_MOE.values())
    configs += [
        local_expert_config(cfg, ep)
        for cfg in list(configs)
        if (experts := num_routed_experts(cfg))
        for ep in (2**i for i in range(1, experts.bit_length()))
        if experts % ep == 0
    ]
    by_old = {_legacy_split_key(c): config_key(c) for c in configs}
    by_old.update({config_key(c): config_key(c) for c in configs})  # already canonical
    splits = {}
    for key, value in snapshot["splits"].items():
        if key not in by_old:
            sys.exit(f"parameter split {key} matches no catalog or reduced MoE config")
        if splits.setdefault(by_old[key], value) != value:
            sys.exit(f"two parameter splits for {by_old[key]}")
    PARAMETER_SPLITS_PATH.write_text(
        json.dumps({"transformers": snapshot["transformers"], "splits": dict(sorted(splits.items()))}, indent=0) + "\n"
    )
    return len(splits)


def rekey_in_place(path: Path) -> int:
    """Rewrite a small terms file's keys to :func:`terms_key` (its lines otherwise unchanged); returns lines re-keyed."""
    out, n = [], 0
    for line in path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            new = terms_key(hf_config_of(e["model_name"]), entry_training(e), e["training"].get("cuda_generation"))
            n += new != e["key"]
            line = json.dumps({**e, "key": new})
        out.append(line)
    path.write_text("\n".join(out) + "\n")
    return n


def check() -> None:
    """Every shipped line is found under its canonical key."""
    cache = TermsCache()
    missing = 0
    for f in sorted(SHIPPED_DIR.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                gen = e["training"].get("cuda_generation")
                if cache.get(terms_key(hf_config_of(e["model_name"]), entry_training(e), gen)) is None:
                    missing += 1
                    print(f"not found: {f.name} {e['model_name']} {e['key']}")
    if missing:
        sys.exit(f"{missing} lines not found under their canonical key")


if __name__ == "__main__":
    print(f"canonical configs: {write_canonical_configs()} entries")
    lines, changed = rekey_terms()
    n_splits = rekey_splits()
    for extra in sorted(TESTS_DATA.glob("terms_*.jsonl")):
        print(f"{extra}: {rekey_in_place(extra)} lines re-keyed")
    check()
    print(
        f"terms: {lines} lines, {changed} keys mapped -> {SHIPPED_DIR / CANONICAL_KEYS_NAME}; "
        f"parameter splits: {n_splits} re-keyed -> {PARAMETER_SPLITS_PATH}; every line found"
    )

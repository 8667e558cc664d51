"""Write ``memfit/catalog_layers.json``, the decoder layers of every catalog model by its name and aliases, that
:func:`memfit.hf.catalog_num_layers` reads in the client (which ships without ``data/``). Run after changing
``data/architectures``:

    python scripts/catalog_layers.py
"""

import json

from data import catalog
from memfit.hf import CATALOG_LAYERS_PATH, spec_fields_from_hf_config


def snapshot() -> dict:
    """``{"source": ..., "num_layers": {name key: layers}}`` for every catalog name and alias."""
    layers = {
        key: spec_fields_from_hf_config(entry["hf_config"])["num_layers"]
        for key, entry in sorted(catalog.load_catalog().items())
    }
    return {"source": "data/architectures/*.json hf_config", "num_layers": layers}


if __name__ == "__main__":
    CATALOG_LAYERS_PATH.write_text(json.dumps(snapshot(), indent=1) + "\n")
    print(f"{len(snapshot()['num_layers'])} names -> {CATALOG_LAYERS_PATH}")

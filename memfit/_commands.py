"""Console-script entry points. The commands run memfit's server-side code (``service.cli``,
``training.sweep``), which ships in the checkout and the Docker image, not in the ``memfit`` wheel;
in a client-only install they exit with a message saying so. Nothing else in :mod:`memfit` imports
server code, and importing this module imports none either.
"""

from __future__ import annotations

import importlib
import sys

_WHERE = (
    "this command runs memfit's server-side code, which is not part of the memfit package: run it "
    "in a memfit checkout (bash scripts/setup.sh) or the Docker image; from a training script use "
    "memfit.Client against a running service"
)


def _run(module: str) -> int:
    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("service", "training", "model", "data"):
            print(f"memfit: {_WHERE}", file=sys.stderr)
            return 1
        raise
    return main()


def memfit() -> int:
    """``memfit``: :func:`service.cli.main`."""
    return _run("service.cli")


def memfit_collect() -> int:
    """``memfit-collect``: :func:`training.sweep.main`."""
    return _run("training.sweep")

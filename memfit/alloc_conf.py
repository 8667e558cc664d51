"""The job's caching-allocator settings: read them for a request, and turn on expandable segments in time.

PyTorch's CUDA caching allocator reads its settings once, when CUDA starts: ``PYTORCH_CUDA_ALLOC_CONF``, else
``PYTORCH_ALLOC_CONF`` (``CUDAAllocatorConfig::instance`` in PyTorch's ``c10/cuda/CUDAAllocatorConfig.h``). memfit
decides the fit by replaying the step through a model of that allocator with the job's settings
(``RecommendRequest.alloc_conf``); :func:`alloc_conf_from_env` gives them, :func:`memfit.describe` and the command
line read them by default.

``expandable_segments:True`` changes no numerics and often lowers k (issue 27: Llama-3-8B on an H100-80GB from
k = 22 to 19); memfit offers it first among the alternatives where it does. :func:`use_expandable_segments` sets
it from the training script, which must run before anything initialises CUDA::

    import memfit
    memfit.use_expandable_segments()   # first lines of the script: before CUDA starts
    import torch
    ...
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import MutableMapping

#: where the CUDA caching allocator reads its settings, in order (c10/cuda/CUDAAllocatorConfig.h)
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def alloc_conf_from_env(env: MutableMapping[str, str] | None = None) -> str:
    """The allocator settings this process's CUDA would use: ``PYTORCH_CUDA_ALLOC_CONF``, else
    ``PYTORCH_ALLOC_CONF``, else ``""`` (PyTorch's defaults)."""
    env = os.environ if env is None else env
    for name in ENV_NAMES:
        value = env.get(name)
        if value is not None:
            return value.strip()
    return ""


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")  # torch not imported yet: CUDA cannot have started
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        return False


def use_expandable_segments(env: MutableMapping[str, str] | None = None) -> bool:
    """Turn on ``expandable_segments:True`` for this process's CUDA caching allocator, keeping the other settings.

    Writes ``PYTORCH_CUDA_ALLOC_CONF`` (the variable CUDA reads first), with the settings it or
    ``PYTORCH_ALLOC_CONF`` already held and ``expandable_segments`` set to True.

    Returns:
        True when it takes effect: CUDA was not initialised yet (``torch.cuda.is_initialized()`` false, or torch
        not imported). False when it is too late: the variable is still set (for child processes, e.g. a launcher's
        workers), and a :class:`memfit.MemfitWarning` says that this process keeps its allocator settings.
    """
    from memfit.checkpointing import MemfitWarning

    env = os.environ if env is None else env
    parts = [p for p in alloc_conf_from_env(env).split(",") if p.strip()]
    kept = [p for p in parts if p.split(":")[0].strip() != "expandable_segments"]
    env[ENV_NAMES[0]] = ",".join([*kept, "expandable_segments:True"])
    if _cuda_initialized():
        warnings.warn(
            "memfit: CUDA is already initialised, so this process keeps its caching-allocator settings; set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the job starts (or call "
            "memfit.use_expandable_segments() before anything uses CUDA)",
            MemfitWarning,
            stacklevel=2,
        )
        return False
    return True

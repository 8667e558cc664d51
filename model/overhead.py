"""From predicted allocated bytes to what actually runs out of memory on a GPU.

A GPU runs out at: allocated bytes + what the caching allocator holds beyond them + memory held outside PyTorch
(CUDA context, cuBLAS workspace, NCCL buffers). Defaults, each sourced:

* CUDA context: 1343 MiB, the figure HF transformers' "Model training anatomy" guide
  (docs/source/en/model_memory_anatomy.md) shows on a V100 after loading only the CUDA kernels;
* cuBLAS workspace: PyTorch's default ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is 8 × 4096 KiB = 32 MiB
  per stream (PyTorch docs, "Reproducibility" / CUDA semantics: cuBLAS workspaces);
* NCCL: 0.5–0.7 GB per process group, as reported in NVIDIA/nccl's GitHub issues on NCCL memory
  use; we take 0.6 GiB when more than one GPU is used;
* the allocator's allowance: 5 % of the allocated peak for a setting no GPU pressure run measured.

**The fit decision** (:mod:`model.reserved`) no longer adds a fragmentation percentage where the step's allocation
stream can be replayed through the caching-allocator model: it takes :meth:`OverheadModel.outside_pytorch` (the
measured context, NCCL on several GPUs) and the cuBLAS residual from here, and falls back to the allocated bound times
:meth:`OverheadModel.allowance_ratio` (the measured reserved / allocated median of the allocator setting, with the
largest request kept free) only without a stream.

**What the fake tracker does not see.** On one H200 (torch 2.11, 26 pairs, ``gpu_validate``) the CUDA
peak allocated bytes were the tracker's plus 66 MiB (median; cuBLAS/cuBLASLt workspaces, which PyTorch
allocates through its caching allocator) in 21 of 26 pairs; GPT-2 (attention dropout, SDPA and eager)
was 0.5–0.9 GiB higher at k = 0, only the workspace higher at k = L. :meth:`OverheadModel.fit` uses that median in place of
the 32 MiB cuBLAS default.

**What a step needs beyond its allocated peak, measured under pressure.** The peak *reserved* bytes of
an unconstrained run are no OOM threshold: with memory to spare the caching allocator keeps freed blocks,
and when ``cudaMalloc`` fails it releases them and retries. ``training/gpu_pressure.py`` bisects the
smallest allocator cap (``torch.cuda.set_per_process_memory_fraction``) under which a step still runs.
On one H200 (2026-11-30, 22 configurations, ``data/telemetry/gpu_validation/h200-2026-11-30``) the step
needed 0.8–28 % more than its allocated peak with the default allocator (median 7.6 %, growing with the
number of checkpointed layers), while the unconstrained reserved/allocated ratio was 1.01–1.34; with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` it needed 0.1–6.7 % (median 2.0 %), reserved/allocated
1.03–1.26. The fallback without a stream (:meth:`OverheadModel.allowance_ratio`) takes the unconstrained
medians (1.079, 1.098), above the needed medians; :meth:`OverheadModel.fit` also learns the outside-PyTorch
bytes (median) per device name from ``method = cuda`` telemetry.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from memfit.api import gpu_catalog_name

MIB = 1 << 20
GIB = 1 << 30
CUDA_CONTEXT_BYTES = 1343 * MIB
CUBLAS_WORKSPACE_BYTES = 32 * MIB
NCCL_BYTES = int(0.6 * GIB)
#: reserved / allocated peak of an allocator setting no GPU pressure run measured (:meth:`OverheadModel.allowance_ratio`)
DEFAULT_ALLOWANCE_RATIO = 1.05
#: Shipped GPU pressure measurements (``training/gpu_pressure.py`` output files).
_VALIDATION_DIR = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "gpu_validation"
PRESSURE_FILES = sorted(_VALIDATION_DIR.glob("*/gpu_pressure_*.json"))
#: Shipped GPU validation runs (``training/gpu_validate.py``): CUDA allocated next to the fake tracker.
VALIDATION_FILES = sorted(_VALIDATION_DIR.glob("*/gpu_validation.json"))


@functools.lru_cache(maxsize=64)
def _median(values: tuple[int, ...]) -> int:
    return int(np.median(values))


def allocated_residuals(paths: list[Path]) -> list[int]:
    """CUDA peak allocated minus the fake tracker's peak (bytes), per measured pair of validation runs."""
    return [
        r["allocated_bytes"] - r["tracker_bytes"]
        for path in paths
        for r in json.loads(Path(path).read_text())["rows"]
        if "tracker_bytes" in r
    ]


def validation_outside(paths: list[Path]) -> dict[str, list[int]]:
    """Memory outside PyTorch (``total - free - reserved``, bytes) per device name, from GPU validation runs that
    name their device (``training/gpu_validate.py`` output: H200, torch 2.11.0+cu130, 2026-11-30 and 12-04)."""
    out: dict[str, list[int]] = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        if run.get("device"):
            figures = [r["outside_torch_bytes"] for r in run["rows"] if r.get("outside_torch_bytes")]
            out.setdefault(run["device"], []).extend(figures)
    return out


def pressure_ratios(paths: list[Path], figure: str = "needed_over_allocated") -> dict[str, list[float]]:
    """Ratios per allocator setting (``"default"`` or the ``PYTORCH_CUDA_ALLOC_CONF`` value) from
    ``training/gpu_pressure.py`` output files: ``figure`` is ``needed_over_allocated`` (the smallest cap the step
    ran under over its allocated peak) or ``reserved_over_allocated`` (the unconstrained run's reserved peak over
    it)."""
    out: dict[str, list[float]] = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        ratios = [r[figure] for r in run["rows"] if figure in r]
        out.setdefault(run.get("alloc_conf") or "default", []).extend(ratios)
    return out


@dataclass(frozen=True)
class Overhead:
    """Bytes on top of predicted allocated memory, per device; ``parameter_block_bytes``: what the caching allocator
    counts as allocated for the parameters beyond their sizes (:func:`model.recommend.parameter_block_bytes`)."""

    fragmentation_bytes: int
    cuda_context_bytes: int
    cublas_workspace_bytes: int
    nccl_bytes: int
    source: str  # "default" or "learned from N cuda rows on <device>"
    parameter_block_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.fragmentation_bytes
            + self.cuda_context_bytes
            + self.cublas_workspace_bytes
            + self.nccl_bytes
            + self.parameter_block_bytes
        )


@dataclass
class OverheadModel:
    """Overhead on top of the predicted allocated peak; defaults until fitted.

    Attributes:
        cublas_workspace_bytes: allocated bytes the fake tracker misses (the cuBLAS workspaces).
        outside_by_device: learned bytes outside PyTorch (context + cuBLAS + NCCL) per device name.
        rows_by_device: CUDA rows each outside-PyTorch figure was learned from.
        allowance_by_setting: reserved / allocated peak per allocator setting (:meth:`allowance_ratio`).
    """

    cublas_workspace_bytes: int = CUBLAS_WORKSPACE_BYTES
    outside_by_device: dict[str, int] = field(default_factory=dict)
    rows_by_device: dict[str, int] = field(default_factory=dict)
    #: reserved / allocated peak ratio per allocator setting (:meth:`allowance_ratio`), from GPU pressure runs
    allowance_by_setting: dict[str, float] = field(default_factory=dict)

    def fit(
        self, rows: pd.DataFrame, pressure_files: list[Path] | None = None, validation_files: list[Path] | None = None
    ) -> OverheadModel:
        """Learn the outside-PyTorch bytes per device from flat telemetry rows with ``method == 'cuda'``
        (others are ignored), the reserved / allocated ratio per allocator setting from GPU pressure measurements
        (default: the shipped :data:`PRESSURE_FILES`) and the allocated bytes the tracker misses (cuBLAS
        workspaces) from GPU validation runs (default: :data:`VALIDATION_FILES`)."""
        if len(rows):
            cuda = rows[(rows.get("method") == "cuda") & ~rows["oom"].astype(bool)]
            cuda = cuda.assign(device_name=cuda["device_name"].map(lambda d: gpu_catalog_name(str(d))))
            for device, g in cuda.groupby("device_name"):
                outside = g["outside_torch_bytes"].dropna()
                if len(outside):
                    self.outside_by_device[device] = int(outside.median())
                    self.rows_by_device[device] = len(outside)
        pressure = PRESSURE_FILES if pressure_files is None else pressure_files
        self.allowance_by_setting = {
            conf: float(max(1.0, np.median(r)))
            for conf, r in pressure_ratios(pressure, "reserved_over_allocated").items()
            if r
        }
        for device, figures in validation_outside(
            VALIDATION_FILES if validation_files is None else validation_files
        ).items():
            device = gpu_catalog_name(device)
            if device not in self.outside_by_device and figures:  # telemetry rows first, shipped runs where none
                self.outside_by_device[device] = int(np.median(figures))
                self.rows_by_device[device] = len(figures)
        residuals = allocated_residuals(VALIDATION_FILES if validation_files is None else validation_files)
        if residuals:
            self.cublas_workspace_bytes = int(np.median(residuals))
        return self

    @staticmethod
    def nccl_bytes(gpu_count: int) -> int:
        """NCCL's communicator buffers per device: :data:`NCCL_BYTES` in a job of more than one GPU, else 0."""
        return NCCL_BYTES if gpu_count > 1 else 0

    def allowance_ratio(self, expandable_segments: bool) -> tuple[float, str]:
        """(reserved / allocated peak ratio, its source) for the default allocator or expandable segments: the
        median of the shipped ``training/gpu_pressure.py`` unconstrained runs with that setting (H200, 2026-11-30:
        1.079 of 24 default runs, 1.098 of 20 expandable runs); :data:`DEFAULT_ALLOWANCE_RATIO` when none was
        measured. The reserved peak of :func:`model.reserved.allowance_fit` where no allocation stream can be
        simulated (which also keeps the default allocator's largest request free)."""
        key = "expandable_segments:True" if expandable_segments else "default"
        ratio = self.allowance_by_setting.get(key)
        if ratio is None:
            return DEFAULT_ALLOWANCE_RATIO, "default 5 % (no GPU pressure run with this setting)"
        return ratio, f"median reserved / allocated of the GPU pressure runs with {key}"

    def outside_pytorch(self, device_name: str | None, gpu_count: int) -> tuple[int, str]:
        """(bytes, source) of device memory PyTorch's allocator cannot use: the CUDA context (with the cuBLAS and
        cuDNN handles' own memory) as ``total - free - reserved`` measured on ``device_name`` by ``method = cuda``
        telemetry or shipped GPU validation runs (0.75 GiB on the H200, torch 2.11, CUDA 13; issue 27 saw 0.51-0.76
        GiB); on a device never measured, the larger of the measured median and the 1343 MiB of HF's "Model training
        anatomy" guide (older stacks load every kernel at start-up); plus :data:`NCCL_BYTES` when ``gpu_count > 1``."""
        nccl = self.nccl_bytes(gpu_count)
        plus = f" + NCCL {NCCL_BYTES / GIB:.1f} GiB ({gpu_count} GPUs)" if nccl else ""
        device_name = gpu_catalog_name(device_name) if device_name else device_name
        if device_name in self.outside_by_device:
            n = self.rows_by_device.get(device_name, 0)
            return self.outside_by_device[device_name] + nccl, f"measured on {device_name} ({n} measured rows){plus}"
        if self.outside_by_device:
            figure = _median(tuple(self.outside_by_device.values()))
            where = ", ".join(
                f"{d} ({self.rows_by_device.get(d, 0)} measured rows)" for d in sorted(self.outside_by_device)
            )
            if figure >= CUDA_CONTEXT_BYTES:
                return figure + nccl, f"measured on {where}; not yet on this GPU{plus}"
        # a GPU never measured keeps the larger guide figure: an older driver or CUDA without lazy module loading
        # holds more than the H200's 0.75 GiB (a public Llama-3-8B ZeRO-3 offload report on RTX-3090s, 13 GB per GPU,
        # is 20 % above memfit's bound even with it)
        return (
            CUDA_CONTEXT_BYTES + nccl,
            (
                "1343 MiB from HF transformers' model memory anatomy guide (measured there on a V100; not yet "
                f"measured on this GPU){plus}"
            ),
        )

    def to_dict(self) -> dict:
        return {
            "cublas_workspace_bytes": self.cublas_workspace_bytes,
            "outside_by_device": self.outside_by_device,
            "rows_by_device": self.rows_by_device,
            "allowance_by_setting": self.allowance_by_setting,
        }

    @classmethod
    def from_dict(cls, d: dict) -> OverheadModel:
        return cls(
            int(d.get("cublas_workspace_bytes", CUBLAS_WORKSPACE_BYTES)),
            {k: int(v) for k, v in d.get("outside_by_device", {}).items()},
            dict(d.get("rows_by_device", {})),
            {k: float(v) for k, v in d.get("allowance_by_setting", {}).items()},
        )

"""From predicted allocated bytes to what actually runs out of memory on a GPU.

A GPU runs out at: allocated bytes + allocator fragmentation (reserved − allocated) + memory held
outside PyTorch (CUDA context, cuBLAS workspace, NCCL buffers). Defaults, each sourced:

* CUDA context: 1343 MiB, the figure HF transformers' "Model training anatomy" guide
  (docs/source/en/model_memory_anatomy.md) shows on a V100 after loading only the CUDA kernels;
* cuBLAS workspace: PyTorch's default ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is 8 × 4096 KiB = 32 MiB
  per stream (PyTorch docs, "Reproducibility" / CUDA semantics: cuBLAS workspaces);
* NCCL: 0.5–0.7 GB per process group, as reported in NVIDIA/nccl's GitHub issues on NCCL memory
  use; we take 0.6 GiB when more than one GPU is used;
* fragmentation: reserved/allocated ratio 1.05 until CUDA telemetry says otherwise.

As soon as telemetry with ``method = cuda`` exists (GPU validation script, or jobs reporting back),
:meth:`OverheadModel.fit` learns the reserved/allocated ratio (95th percentile) and the outside-PyTorch
bytes (median) per device name; the defaults stay for devices never seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

MIB = 1 << 20
GIB = 1 << 30
CUDA_CONTEXT_BYTES = 1343 * MIB
CUBLAS_WORKSPACE_BYTES = 32 * MIB
NCCL_BYTES = int(0.6 * GIB)
FRAGMENTATION_RATIO = 1.05


@dataclass(frozen=True)
class Overhead:
    """Bytes on top of predicted allocated memory, per device."""

    fragmentation_bytes: int
    cuda_context_bytes: int
    cublas_workspace_bytes: int
    nccl_bytes: int
    source: str  # "default" or "learned from N cuda rows on <device>"

    @property
    def total_bytes(self) -> int:
        return self.fragmentation_bytes + self.cuda_context_bytes + self.cublas_workspace_bytes + self.nccl_bytes


@dataclass
class OverheadModel:
    """Per-device-name overhead; defaults until fitted on CUDA telemetry.

    Attributes:
        ratio_by_device: learned reserved/allocated ratio per device name.
        outside_by_device: learned bytes outside PyTorch (context + cuBLAS + NCCL) per device name.
        rows_by_device: CUDA rows each figure was learned from.
    """

    ratio_by_device: dict[str, float] = field(default_factory=dict)
    outside_by_device: dict[str, int] = field(default_factory=dict)
    rows_by_device: dict[str, int] = field(default_factory=dict)

    def fit(self, rows: pd.DataFrame) -> OverheadModel:
        """Learn from flat telemetry rows with ``method == 'cuda'`` (others are ignored)."""
        cuda = rows[(rows.get("method") == "cuda") & rows["peak_reserved_bytes"].notna() & ~rows["oom"].astype(bool)]
        for device, g in cuda.groupby("device_name"):
            ratio = (g["peak_reserved_bytes"] / g["peak_allocated_bytes"]).to_numpy(dtype=float)
            self.ratio_by_device[device] = float(max(1.0, np.quantile(ratio, 0.95)))
            outside = g["outside_torch_bytes"].dropna()
            if len(outside):
                self.outside_by_device[device] = int(outside.median())
            self.rows_by_device[device] = len(g)
        return self

    def total_bytes(self, allocated_bytes: Sequence[int], device_name: str | None, gpu_count: int) -> list[int]:
        """``allocated + overhead(allocated).total_bytes`` for each allocated peak (e.g. a whole curve
        over k) in one pass: the overhead is a fixed part plus a fraction of the allocated bytes."""
        ratio = self.ratio_by_device.get(device_name or "", FRAGMENTATION_RATIO)
        o = self.overhead(0, device_name, gpu_count)
        fixed = o.cuda_context_bytes + o.cublas_workspace_bytes + o.nccl_bytes
        return [a + int(a * (ratio - 1)) + fixed for a in allocated_bytes]

    def overhead(self, allocated_bytes: float, device_name: str | None, gpu_count: int) -> Overhead:
        """Overhead for a predicted allocated peak on ``device_name`` in a job of ``gpu_count`` GPUs."""
        ratio = self.ratio_by_device.get(device_name or "", FRAGMENTATION_RATIO)
        nccl = NCCL_BYTES if gpu_count > 1 else 0
        if device_name in self.outside_by_device:
            outside = self.outside_by_device[device_name]
            # the learned figure comes from single-GPU validation runs: NCCL is added for multi-GPU jobs
            return Overhead(int(allocated_bytes * (ratio - 1)), outside, 0, nccl,
                            f"learned from {self.rows_by_device[device_name]} cuda rows on {device_name}")
        return Overhead(int(allocated_bytes * (ratio - 1)), CUDA_CONTEXT_BYTES, CUBLAS_WORKSPACE_BYTES, nccl,
                        "default" if device_name not in self.ratio_by_device else
                        f"fragmentation learned from {self.rows_by_device[device_name]} cuda rows")

    def to_dict(self) -> dict:
        return {"ratio_by_device": self.ratio_by_device, "outside_by_device": self.outside_by_device,
                "rows_by_device": self.rows_by_device}

    @classmethod
    def from_dict(cls, d: dict) -> OverheadModel:
        return cls(dict(d.get("ratio_by_device", {})), {k: int(v) for k, v in d.get("outside_by_device", {}).items()},
                   dict(d.get("rows_by_device", {})))

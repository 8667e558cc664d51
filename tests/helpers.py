"""Shared test builders (not fixtures, so tests read top to bottom)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from memfit.schema import ClusterSpec, Measurement, ModelSpec, TelemetryRecord, TrainingConfig

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


#: the public Llama-3-8B job with ZeRO-3, optimizer and parameter offload (8 x RTX-3090, ~13 GB per GPU reported)
ZERO3_FULL_OFFLOAD_TRAINING = {
    "micro_batch_size": 1,
    "seq_len": 1024,
    "precision": "bf16_fp32_master",
    "sharding": "zero3",
    "offload_optimizer": "cpu",
    "offload_parameters": "cpu",
}


def answer(**over) -> dict:
    """A valid ``/recommend`` answer body (memfit.api.Recommendation) of a stand-in service; keyword overrides."""
    base = {
        "fits": True,
        "k": 2,
        "layers": [0, 1],
        "num_layers": 32,
        "predicted_peak_bytes": 70 << 30,
        "upper_bound_bytes": 72 << 30,
        "total_upper_bytes": 74 << 30,
        "capacity_bytes": 80 << 30,
        "usable_bytes": 76 << 30,
        "curve": [{"k": 0, "predicted_bytes": 1, "upper_bytes": 2, "total_upper_bytes": 3, "fits": True}],
        "breakdown": {"parameters_bytes": 16 << 30},
        "overhead": {"total_bytes": 1},
        "recompute_overhead_fraction": 0.02,
        "model_version": "0003",
    }
    return {**base, **over}


def record(**over: Any) -> TelemetryRecord:
    """A valid record; keyword overrides go to the part that owns the field."""
    parts: dict[str, dict[str, Any]] = {
        "model": {
            "architecture": "llama",
            "model_name": "tiny",
            "num_layers": 4,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 256,
            "total_params": 100_000,
            "trainable_params": 100_000,
        },
        "training": {"micro_batch_size": 2, "seq_len": 128, "checkpoint_layers": [0, 1]},
        "cluster": {"device_name": "fake-cpu", "device_memory_bytes": 1 << 34, "gpu_count": 1},
        "measurement": {"peak_allocated_bytes": 123_456_512, "method": "fake_tracker"},
    }
    top: dict[str, Any] = {}
    owners = {"model": ModelSpec, "training": TrainingConfig, "cluster": ClusterSpec, "measurement": Measurement}
    for k, v in over.items():
        for part, cls in owners.items():
            if k in cls.model_fields:
                parts[part][k] = v
                break
        else:
            top[k] = v
    return TelemetryRecord(**{p: owners[p](**d) for p, d in parts.items()}, **top)


#: per-request timeout of the tests' calls to a real service: generous, because a model reload or the first
#: request after start-up runs in the request on a CI box whose 2 cores the suite shares (httpx's default is 5 s)
HTTP_TIMEOUT_S = 60.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_service(registry_dir, db_url: str | None, *, wait_for: str = "/v2/health/ready", **env_extra: str):
    """Start ``python -m service`` (real uvicorn) on a free loopback port; yields its base URL once
    ``wait_for`` answers 200 (``/v2/health/live`` for a server expected to start without a model) and,
    for readiness, its start-up warm-up has finished (a first request on a loaded 2-core box otherwise
    waits behind it)."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    port = free_port()
    env = {**os.environ, "MEMFIT_PORT": str(port), "MEMFIT_REGISTRY_DIR": str(registry_dir), **env_extra}
    if "MEMFIT_DATA_DIR" in env_extra:
        env.pop("MEMFIT_DB_URL", None)  # the data directory's own store (tests/conftest.py sets a temporary one)
    if db_url is not None:
        env["MEMFIT_DB_URL"] = db_url
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(base + wait_for, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read().decode()[-3000:])
            time.sleep(0.3)
        else:
            raise RuntimeError("server did not become ready")
        while wait_for == "/v2/health/ready" and time.time() < deadline:  # start-up work (catalog configs) done
            try:
                if httpx.get(base + wait_for, timeout=5).json().get("details", {}).get("warmed_up", True):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python examples/<script> <args>`` from the repository root, output captured (5 minutes at most)."""
    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, str(root / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        check=False,
    )

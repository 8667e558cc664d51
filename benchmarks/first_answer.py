"""Seconds from a never-seen configuration's first ``POST /recommend`` to its first *full* answer: traced terms
(``path`` = ``traced``) and the fit decided by replaying the step through the caching-allocator model
(``fit_method`` = ``simulated``), not on the measured allowance.

    python -m benchmarks.first_answer [--out benchmarks/results/first_answer.json] [--timeout-s 120]

Starts the service (``python -m service``) with an empty allocation-stream cache and telemetry store, waits for
it to be warmed up (its tracing process may still be starting), then for each case posts the request every 0.25 s
until the answer is full. Target (issue
27): at most 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
JOB = {
    "training": {"micro_batch_size": 2, "seq_len": 4096, "precision": "bf16", "optimizer": "adamw_fused"},
    "cluster": {"gpu": "H100-80GB"},
    "headroom_fraction": 0.0,
}


def _cases() -> dict[str, dict]:
    from data import catalog

    llama = catalog.get("llama-3-8b")["hf_config"]
    return {
        # issue 27's first job: its terms are traced and its stream template recorded
        "llama-3-8b bf16 fused AdamW mb2 s4096 on H100-80GB": {
            **JOB,
            "model": "llama-3-8b",
        },
        # an architecture never seen: its terms are traced and its stream template recorded
        "llama-3-8b with vocab 100352 (never seen)": {**JOB, "model": {**llama, "vocab_size": 100352}},
        # issue 27's second job: LoRA on a 24 GB card (nothing fits with the default allocator)
        "llama-3.2-3b LoRA r16 q,k,v,o bf16 mb2 s4096 on RTX-4090": {
            **JOB,
            "model": "llama-3.2-3b",
            "training": {
                **JOB["training"],
                "finetune": "lora",
                "lora_rank": 16,
                "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            },
            "cluster": {"gpu": "RTX-4090"},
        },
    }


def _full(answer: dict) -> bool:
    return answer.get("path") == "traced" and answer.get("fit_method") == "simulated"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_answer", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "first_answer.json")
    p.add_argument("--timeout-s", type=float, default=120.0)
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="memfit-first-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MEMFIT_PORT": str(port),
        "MEMFIT_HOST": "127.0.0.1",
        "MEMFIT_DB_URL": f"sqlite:///{tmp / 'bench.db'}",
        "MEMFIT_STREAM_CACHE": str(tmp / "streams"),
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    out: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"}
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                ready = httpx.get(base + "/v2/health/ready", timeout=5)
                if ready.status_code == 200 and ready.json().get("details", {}).get("warmed_up"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        for name, body in _cases().items():
            t0 = time.perf_counter()
            first = None
            while True:
                r = httpx.post(base + "/recommend", json=body, timeout=60)
                answer = r.json()
                first = first or {
                    "status": r.status_code,
                    "path": answer.get("path"),
                    "fit_method": answer.get("fit_method"),
                    "k": answer.get("k"),
                    "s": round(time.perf_counter() - t0, 2),
                }
                elapsed = time.perf_counter() - t0
                if r.status_code == 200 and _full(answer):
                    out[name] = {"first_answer": first, "full_answer_s": round(elapsed, 2), "k": answer.get("k")}
                    break
                if elapsed > a.timeout_s:
                    out[name] = {"first_answer": first, "full_answer_s": None, "last_warnings": answer.get("warnings")}
                    break
                time.sleep(0.25)
            print(f"{name}: {out[name]}")
    finally:
        proc.terminate()
        proc.wait(30)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()

"""Issue 10, fault 10: installing memfit must not put top-level data/model/service/training into site-packages."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_client_wheel_installs_only_memfit(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    wheel = next((tmp_path / "dist").glob("memfit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {"memfit/peft_lora_targets.json", "memfit/sdpa_support.json"} <= set(names)  # package data memfit.hf reads
    tops = {n.split("/")[0] for n in names}
    assert tops == {"memfit", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    before = {p.name for p in site.iterdir()}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        check=True,
        timeout=300,
    )
    added = {p.name for p in site.iterdir()} - before
    assert {a for a in added if not a.endswith(".dist-info")} == {"memfit"}
    assert not {"data", "model", "service", "tracer", "training"} & {p.name for p in site.iterdir()}
    # the console script says plainly that it needs the server parts, instead of a traceback (pydantic and
    # httpx borrowed from this venv's site-packages: a path entry, so its .pth files are not processed)
    done = subprocess.run(
        [venv / "bin" / "memfit", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": sysconfig.get_paths()["purelib"]},
    )
    assert done.returncode == 1 and "not part of the memfit package" in done.stderr


def test_checkout_venv_runs_the_server_parts():
    """scripts/setup.sh puts the checkout on the dev venv's path: the server parts import from anywhere."""
    pth = Path(sysconfig.get_paths()["purelib"]) / "memfit-checkout.pth"
    assert pth.read_text().strip() == str(ROOT)

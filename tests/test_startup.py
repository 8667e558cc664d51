"""Issue 30 items 2-3: an empty or broken registry is seeded from the shipped model and the banner says so;
nothing servable refuses to start with the reason; a server killed with -9 is back within 5 s."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from model.registry import DEFAULT_ROOT, Registry
from service.startup import NothingToServe, ensure_servable
from training.main import bind_refusal

SHIPPED = (DEFAULT_ROOT / "CURRENT").read_text().strip()
ROOT = Path(__file__).resolve().parent.parent


def _broken_copy(dst: Path) -> Path:
    """A registry holding the shipped version with one byte of model.txt flipped (checksum mismatch)."""
    shutil.copytree(DEFAULT_ROOT / SHIPPED, dst / SHIPPED)
    (dst / "CURRENT").write_text(SHIPPED)
    f = dst / SHIPPED / "model.txt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    return dst


def test_empty_registry_is_seeded_from_the_shipped_model(tmp_path):
    version, note = ensure_servable(tmp_path / "models")
    assert version == SHIPPED
    assert note.startswith(f"seeded the registry with the shipped model {SHIPPED} (checksum verified)")
    assert "empty" in note
    assert Registry(tmp_path / "models").load().version == SHIPPED


def test_broken_registry_is_reseeded_and_says_why(tmp_path):
    reg = _broken_copy(tmp_path / "models")
    version, note = ensure_servable(reg)
    assert version == SHIPPED and "seeded" in note and "sha256" in note
    assert Registry(reg).load().version == SHIPPED


def test_nothing_servable_refuses_with_both_reasons(tmp_path):
    shipped = _broken_copy(tmp_path / "shipped")
    with pytest.raises(NothingToServe, match=r"registry is empty.*shipped model.*sha256"):
        ensure_servable(tmp_path / "models", shipped_root=shipped)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(env: dict, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "training.main", "--data-dir", env["MEMFIT_DATA_DIR"]],
        cwd=ROOT,
        env={**env, "MEMFIT_PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_live(port: int, proc: subprocess.Popen, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            time.sleep(0.05)
    return None


def _plain_bind_refused(port: int) -> bool:
    """Whether a socket without SO_REUSEADDR is refused 127.0.0.1:port (a TIME-WAIT connection holds it)."""
    with socket.socket() as plain:
        try:
            plain.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_time_wait_port_is_reused_by_the_service_probe():
    """A port held only by a TIME-WAIT connection (made here by an active close on the listening side) is
    refused to a plain bind on Linux and must be accepted by the service's SO_REUSEADDR probe."""

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.listen(1)
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server side closes first: it, not the client, goes to TIME-WAIT
        client.recv(1)
        client.close()
    if not _plain_bind_refused(port):
        pytest.skip("this network stack keeps no TIME-WAIT state (a plain bind is accepted)")
    assert bind_refusal("127.0.0.1", port) is None


def test_restart_after_kill_9_is_not_kept_off_its_port(tmp_path):
    """Kill -9 with a client connection open leaves the server's side in TIME-WAIT; the restart must bind."""
    env = {**os.environ, "MEMFIT_DATA_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("MEMFIT_DB_URL", None)  # the data directory's own store
    port = _free_port()
    first = _start(env, port)
    try:
        assert _wait_live(port, first, 300) is not None, first.stdout.read() if first.poll() is not None else ""
        for _ in range(3):  # keep-alive connections: the server closes first when it dies -> TIME-WAIT
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            conn.recv(4096)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        conn.close()
        # an empty MEMFIT_DATA_DIR: the first start seeded it from the shipped model and said so
        assert f"[2/3] seeded the registry with the shipped model {SHIPPED} (checksum verified)" in first.stdout.read()
        # Linux keeps the killed server's side in TIME-WAIT and a bind without SO_REUSEADDR is refused; some
        # network stacks (gVisor sandboxes, tcp_max_tw_buckets=0) drop it. The restart must bind either way.
        print(f"port {port} after kill -9: plain bind {'refused' if _plain_bind_refused(port) else 'accepted'}")
        second = _start(env, port)
        try:
            out = second.stdout
            # the seeded registry from the first start is current: the banner says so
            restart_s = _wait_live(port, second, 300)
            assert restart_s is not None, second.stdout.read() if second.poll() else ""
            print(f"restart serving after {restart_s:.1f} s")
            # issue 30: back within 5 s; a machine busier than its cores gets slack for start-up CPU, not the port
            assert restart_s < (5.0 if os.getloadavg()[0] < (os.cpu_count() or 1) else 15.0)
        finally:
            second.kill()
            text = out.read()
        assert "[2/3] model" in text and "is current" in text and "cannot listen" not in text
    finally:
        first.kill()


def test_broken_registry_banner_and_refusal(tmp_path):
    """training.main on a data dir whose model is corrupted: re-seeded, and the banner says why."""
    _broken_copy(tmp_path / "models")
    env = {**os.environ, "MEMFIT_DATA_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("MEMFIT_DB_URL", None)  # the data directory's own store
    out = subprocess.run(
        [sys.executable, "-m", "training.main", "--no-serve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("[2/3]"))
    assert line.startswith(f"[2/3] seeded the registry with the shipped model {SHIPPED} (checksum verified)")
    assert "sha256" in line and "does not match" in line


#: a fresh interpreter's first reads of transformers from four threads at once (the service's warm-up and requests)
_FIRST_TOUCHES = """
import sys, threading
import data.catalog, memfit.hf, model.job
assert "transformers" not in sys.modules
errors, go = [], threading.Barrier(4)
def first_touch(f):
    go.wait()
    try:
        f()
    except Exception as err:
        errors.append(f"{type(err).__name__}: {err}")
gemma, llama = (data.catalog.get(n)["hf_config"] for n in ("gemma-3-1b", "llama-3.2-1b"))
touches = [model.job.known_architectures, lambda: memfit.hf._hf_config(gemma),
           lambda: memfit.hf.layer_type_cycle(gemma, 13), lambda: memfit.hf._hf_config(llama)]
threads = [threading.Thread(target=first_touch, args=(f,)) for f in touches]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""


def test_threads_reading_transformers_first_at_once_do_not_break_its_import():
    """transformers 5 half-initialised when a second thread imported it (the warm-up and a first request: HTTP 500
    "cannot import name 'AutoConfig' from 'transformers'", 4 of 4 tries of this script before
    ``memfit.hf.import_transformers``)."""
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_TOUCHES], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def test_log_level_reaches_uvicorn_and_memfits_loggers(monkeypatch, tmp_path):
    """``MEMFIT_LOG_LEVEL=info`` shows the tracing process's recordings (logged at INFO on ``memfit.service``);
    the default stays at warnings; anything else is refused naming the setting and the allowed values."""
    import logging

    import uvicorn
    from pydantic import ValidationError

    from service.app import serve
    from service.settings import Settings

    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append(kw))
    monkeypatch.setenv("MEMFIT_LOG_LEVEL", "info")
    memfit_log = logging.getLogger("memfit")
    before = memfit_log.level, list(memfit_log.handlers)
    try:
        serve(Settings(data_dir=tmp_path), app=object())
        assert ran[-1]["log_level"] == "info" and logging.getLogger("memfit.service").isEnabledFor(logging.INFO)
        monkeypatch.delenv("MEMFIT_LOG_LEVEL")
        serve(Settings(data_dir=tmp_path), app=object())
        assert ran[-1]["log_level"] == "warning" and not logging.getLogger("memfit.service").isEnabledFor(logging.INFO)
    finally:
        memfit_log.setLevel(before[0])
        memfit_log.handlers[:] = before[1]
    monkeypatch.setenv("MEMFIT_LOG_LEVEL", "verbose")
    with pytest.raises(ValidationError, match="log_level") as err:
        Settings(data_dir=tmp_path)
    assert "'debug', 'info', 'warning' or 'error'" in str(err.value)

"""Issue 30, item 6: ``memfit recommend``'s stdout carries only the answer (``--json``: exactly one JSON document), no
library output reaches stderr at the default log level, and a repeated local answer comes from the on-disk answer
cache without loading the predictor (7-12 s before; ``benchmarks/results/cli_latency.txt``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from service.answer_cache import AnswerCache, store_rows

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["recommend", "--model", "llama-3-8b", "--gpu", "H100-80GB", "--micro-batch", "1", "--seq-len", "512", "--json"]

# the libraries' noise as the issue saw it, made while the answer is worked out: DeepSpeed's logger writes
# "[WARNING] ... Setting accelerator to CPU" to the sys.stdout it held at import, transformers warns through
# `warnings` and its logger, bitsandbytes logs the missing `kernels` package
NOISY = textwrap.dedent("""
    import logging, sys, warnings
    import service.cli as cli

    real = cli._recommend_uncached

    def noisy(req, registry):
        import deepspeed  # noqa: F401  (on CPU: its accelerator warning, on stdout)
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
        warnings.warn("transformers: some deprecation")
        logging.getLogger("bitsandbytes").error("No module named 'kernels'")
        logging.getLogger("transformers").warning("a transformers warning")
        return real(req, registry)

    cli._recommend_uncached = noisy
    sys.exit(cli.main(sys.argv[1:]))
""")


def _run(argv: list[str], cache: str, script: str | None = None, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEMFIT_ANSWER_CACHE": cache, "PYTHONPATH": str(ROOT), **env_extra}
    cmd = [sys.executable, "-c", script, *argv] if script else [sys.executable, "-m", "service.cli", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)


def test_stdout_is_one_json_document_and_stderr_has_no_library_output(small_registry):
    argv = [*ARGS, "--registry", str(small_registry.root)]
    proc = _run(argv, "off", NOISY)
    assert proc.returncode in (0, 3), proc.stderr
    assert json.loads(proc.stdout)["model_name"] == "llama-3-8b"  # exactly one document: json.loads refuses more
    assert proc.stderr == ""
    verbose = _run([*argv, "--verbose"], "off", NOISY)  # --verbose shows the libraries' output, on stderr
    assert json.loads(verbose.stdout) == json.loads(proc.stdout)
    assert "Setting accelerator to CPU" in verbose.stderr and "No module named 'kernels'" in verbose.stderr


#: service.cli's main, then the names of the modules it loaded written to $MEMFIT_TEST_MODULES
LOADED = textwrap.dedent("""
    import os, sys
    import service.cli as cli

    rc = cli.main(sys.argv[1:])
    with open(os.environ["MEMFIT_TEST_MODULES"], "w") as f:
        f.write("\\n".join(sys.modules))
    sys.exit(rc)
""")
#: what answering a catalog model loads (the 7-12 s of issue 30; timings in benchmarks/results/cli_latency.txt)
PREDICTOR_MODULES = {"lightgbm", "model.curve"}


def test_a_repeated_answer_comes_from_the_cache_without_loading_the_predictor(tmp_path):
    # a store of its own: the key follows the store's rows, and the worker's shared store (tests/conftest.py) may be
    # written between the two runs by what other tests left running
    cache, db = str(tmp_path / "answers"), f"sqlite:///{tmp_path / 'telemetry.db'}"
    loaded = tmp_path / "modules.txt"
    first = _run(ARGS, cache, LOADED, MEMFIT_DB_URL=db, MEMFIT_TEST_MODULES=str(loaded))
    assert first.returncode in (0, 3) and first.stderr == "", first.stderr
    assert PREDICTOR_MODULES <= set(loaded.read_text().splitlines())  # a miss works the answer out
    assert len(list(Path(cache).glob("*.json"))) == 1
    again = _run(ARGS, cache, LOADED, MEMFIT_DB_URL=db, MEMFIT_TEST_MODULES=str(loaded))
    assert again.returncode == first.returncode and again.stdout == first.stdout and again.stderr == ""
    assert len(list(Path(cache).glob("*.json"))) == 1  # a hit: a miss would have stored a second answer
    assert not (PREDICTOR_MODULES | {"torch", "transformers"}) & set(loaded.read_text().splitlines())


def test_the_key_follows_the_request_the_registry_and_the_store(tmp_path, small_registry):
    import sqlite3

    cache = AnswerCache(tmp_path / "answers")
    db = tmp_path / "t.db"
    url = f"sqlite:///{db}"
    assert store_rows(url) == {}  # an absent store reads as an empty one (a fresh checkout's second run hits)
    key = cache.key('{"a": 1}', small_registry.root, url)
    assert key == cache.key('{"a": 1}', small_registry.root, url)
    assert key != cache.key('{"a": 2}', small_registry.root, url)
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE phase_terms (key TEXT)")
    assert cache.key('{"a": 1}', small_registry.root, url) == key  # created but empty: the same answers
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO phase_terms VALUES ('traced')")
    assert cache.key('{"a": 1}', small_registry.root, url) != key  # a traced configuration may change the answer
    assert cache.key('{"a": 1}', tmp_path, url) != cache.key('{"a": 1}', small_registry.root, url)
    assert cache.key('{"a": 1}', small_registry.root, "postgresql://h/db") is None  # not cached
    cache.put(key, '{"x": 1}')
    assert cache.get(key) == '{"x": 1}' and cache.get("0" * 64) is None

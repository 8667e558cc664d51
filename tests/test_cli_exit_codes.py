"""``memfit recommend`` exit codes (issue 28): 2 only for input the user can fix, naming the flag; a fault of memfit
exits 4 as "memfit: internal error: <type>: <message>". Before, Qwen2.5-72B with ``--tensor-parallel 8`` on
8 x H100 printed ``memfit: error: math domain error`` with exit 2, as if a flag were wrong.
"""

from __future__ import annotations

import pytest

from service.cli import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_NO_FIT, main

QWEN_TP8 = [
    "recommend",
    "--model",
    "qwen2.5-72b",
    "--gpu",
    "H100-80GB",
    "--gpus",
    "8",
    "--tensor-parallel",
    "8",
    "--micro-batch",
    "1",
    "--seq-len",
    "2048",
]


@pytest.fixture()
def no_traces(monkeypatch):
    """The command line's inline tracer answers 'not traced' at once (a 72B trace is minutes of CPU)."""
    from service.tracing import InlineTracer

    monkeypatch.setattr(InlineTracer, "__call__", lambda self, key, hf_config, training: "not traced in this test")


def test_qwen2_5_72b_tp8_on_8_h100_is_answered_not_a_bad_input(small_registry, capsys, no_traces):
    code = main([*QWEN_TP8, "--registry", str(small_registry.root)])
    out, err = capsys.readouterr()
    assert code == EXIT_NO_FIT, err  # 135 GiB of states per rank: nothing fits, alternatives printed
    assert "math domain error" not in err and "alternatives" in out


def test_an_internal_error_exits_4_with_its_type_not_2(small_registry, capsys, monkeypatch, no_traces):
    from service.recommender import Recommender

    def fail(self, req):
        raise ValueError("math domain error")

    monkeypatch.setattr(Recommender, "recommend", fail)
    code = main([*QWEN_TP8, "--registry", str(small_registry.root)])
    err = capsys.readouterr().err
    assert code == EXIT_INTERNAL
    assert err.startswith("memfit: internal error: ValueError: math domain error (raised at test_cli_exit_codes.py:")


def test_bad_input_still_exits_2_naming_the_flag(small_registry, capsys):
    code = main(
        [
            "recommend",
            "--model",
            "qwen2.5-72b",
            "--gpu",
            "H100-80GB",
            "--gpus",
            "8",
            "--tensor-parallel",
            "16",
            "--micro-batch",
            "1",
            "--seq-len",
            "2048",
            "--registry",
            str(small_registry.root),
        ]
    )
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and "--tensor-parallel" in err and "internal error" not in err


def test_help_lists_exit_code_4(capsys):
    with pytest.raises(SystemExit):
        main(["recommend", "--help"])
    assert "internal error" in capsys.readouterr().out

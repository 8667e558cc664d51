"""``memfit recommend``: any model (catalog, --config file or folder, HF cache), output, errors, exit codes.

Answers come from the test registry (``small_registry``) through :class:`service.recommender.Recommender`,
or from a stand-in HTTP server for ``--url`` (503, 422, unreachable).
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from memfit.api import GPUS
from service.cli import EXIT_BAD_INPUT, EXIT_FITS, EXIT_NO_ANSWER, EXIT_NO_FIT, layer_ranges, main
from tests.helpers import answer, free_port

DATA = Path(__file__).resolve().parent / "data"
QWEN3 = (
    DATA / "qwen3-0.6b.json"
)  # Qwen/Qwen3-0.6B's config.json, read as a file (--config) or from a local HF cache under another id
BASE = ["--micro-batch", "1", "--seq-len", "512"]


@pytest.fixture()
def run(small_registry, capsys):
    """``run(*argv) -> (exit code, stdout, stderr)`` against the test registry."""

    def _run(*argv: str, registry: bool = True):
        extra = ["--registry", str(small_registry.root)] if registry and argv and argv[0] == "recommend" else []
        code = main([*argv, *extra])
        out = capsys.readouterr()
        return code, out.out, out.err

    return _run


def test_config_file_outside_the_catalog_gets_a_plan(run):
    code, out, err = run("recommend", "--config", str(QWEN3), "--gpu", "H200", *BASE, "--json")
    assert code == EXIT_FITS, err
    rec = json.loads(out)
    assert rec["num_layers"] == 28 and rec["fits"] is True
    assert rec["capacity_bytes"] == GPUS["H200"]  # bytes in JSON: units only at the edges
    assert [c["k"] for c in rec["curve"]] == list(range(29))


def test_config_folder_and_file_give_the_same_answer(run, tmp_path):
    shutil.copy(QWEN3, tmp_path / "config.json")
    args = ("--gpu", "RTX-4090", "--micro-batch", "1", "--seq-len", "2048", "--json")
    code_file, out_file, _ = run("recommend", "--config", str(QWEN3), *args)
    code_dir, out_dir, _ = run("recommend", "--config", str(tmp_path), *args)
    assert code_file == code_dir
    a, b = json.loads(out_file), json.loads(out_dir)
    assert (a["k"], a["total_upper_bytes"], a["curve"]) == (b["k"], b["total_upper_bytes"], b["curve"])


def test_hf_id_is_resolved_from_the_local_cache_only(run, tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--qwen3-0.6b-sft" / "snapshots" / "c1899de289a04d12100db370d81485cdf75e47ca"
    snapshot.mkdir(parents=True)
    shutil.copy(QWEN3, snapshot / "config.json")
    (cache / "models--acme--qwen3-0.6b-sft" / "refs").mkdir()
    (cache / "models--acme--qwen3-0.6b-sft" / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    code, out, err = run("recommend", "--model", "acme/qwen3-0.6b-sft", "--gpu", "H200", *BASE, "--json")
    assert code == EXIT_FITS, err
    assert json.loads(out)["num_layers"] == 28

    code, out, err = run("recommend", "--model", "Qwen/Qwen3-32B", "--gpu", "H200", *BASE)
    assert code == EXIT_BAD_INPUT and out == ""
    assert "not in the catalog" in err and "local HF cache" in err and str(cache) in err and "--config" in err


def test_catalog_name_and_unknown_name(run):
    code, out, err = run("recommend", "--model", "meta-llama/Meta-Llama-3-8B", "--gpu", "H200", *BASE, "--json")
    assert code in (EXIT_FITS, EXIT_NO_FIT), err
    assert json.loads(out)["model_name"] == "llama-3-8b"
    code, out, err = run("recommend", "--model", "llama-3-9b", "--gpu", "H200", *BASE)
    assert code == EXIT_BAD_INPUT and "close matches" in err and "llama-3-8b" in err and "--config" in err
    assert "model: model:" not in err and "memfit models" in err


def test_table_marks_the_chosen_k_and_explain_draws_the_curve(run):
    code, out, err = run("recommend", "--config", str(QWEN3), "--gpu-memory-gib", "200", *BASE)
    assert code == EXIT_FITS, err
    assert "◀ chosen k" in out and "checkpoint" in out
    assert "breakdown" not in out  # only with --explain
    code, out, err = run("recommend", "--config", str(QWEN3), "--gpu-memory-gib", "200", *BASE, "--explain")
    assert code == EXIT_FITS, err
    assert "breakdown at k=" in out and "bars from" in out and "usable" in out
    chart = [line for line in out.splitlines() if line.startswith("k=")]
    assert chart and sum("◀ chosen k" in line for line in chart) == 1


def test_nothing_fits_exits_3_with_alternatives(run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(
        "recommend", "--config", str(QWEN3), "--gpu-memory-gib", "4", "--micro-batch", "8", "--seq-len", "4096"
    )
    assert code == EXIT_NO_FIT, err
    assert "does not fit at any k" in out and "alternatives" in out
    # the curve table has no chosen-k column when no k is chosen (it stood empty on every row)
    lines = out.splitlines()
    start = [line.strip() for line in lines].index("memory over k (GiB; k = checkpointed layers)")
    assert [c.strip() for c in lines[start + 2].strip("┃").split("┃")] == ["k", "predicted", "bound+overhead", "fits"]
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in lines[start + 4 : end]]
    assert [r[0] for r in rows] == ["0", "3", "6", "9", "12", "15", "18", "21", "24", "27", "28"]
    assert all(len(r) == 4 and r[3] == "no" for r in rows), rows


def test_alternatives_read_in_80_columns(run, monkeypatch):
    """One table row per alternative (its change wraps, nothing else does) and each cost on a numbered line below
    the table, so an 80-column terminal keeps the figures on one line (the cost column wrapped rows over a dozen
    lines)."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(
        "recommend",
        "--config",
        str(QWEN3),
        "--gpu-memory-gib",
        "4",
        "--micro-batch",
        "8",
        "--seq-len",
        "4096",
        "--json",
    )
    alternatives = json.loads(out)["alternatives"]
    assert code == EXIT_NO_FIT and alternatives
    code, out, _ = run(
        "recommend", "--config", str(QWEN3), "--gpu-memory-gib", "4", "--micro-batch", "8", "--seq-len", "4096"
    )
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    start = next(i for i, line in enumerate(lines) if "alternatives" in line)
    for i, a in enumerate(alternatives, 1):
        row = next(line for line in lines[start:] if line.startswith(f"│ {i} │"))
        cells = [c.strip() for c in row.strip("│").split("│")]
        k = "-" if a["k"] is None else str(a["k"])  # an alternative that does not fit has no k ("None" before)
        assert cells[2:5] == ["yes" if a["fits"] else "no", k, f"{a['total_upper_bytes'] / 2**30:.2f}"]
        assert any(line.startswith(f"  {i}. cost: {a['cost'][:30]}") for line in lines)


def test_wrapped_costs_and_warnings_hang_under_their_number_or_bullet(run):
    # in 80 columns a wrapped warning or cost went on at column 0, under "warning:" / "1.", not under its text
    import io

    from rich.console import Console

    from memfit.api import Recommendation
    from service.cli import render

    code, out, _ = run(
        "recommend",
        "--config",
        str(QWEN3),
        "--gpu-memory-gib",
        "4",
        "--micro-batch",
        "8",
        "--seq-len",
        "4096",
        "--json",
    )
    rec = Recommendation.model_validate(json.loads(out))
    assert code == EXIT_NO_FIT and rec.alternatives
    rec.alternatives[0].cost = "smaller GEMMs: ~15% slower steps at the same global batch, " * 2  # two lines at least
    rec.warnings.append("a warning long enough to wrap twice in eighty columns: " * 3)
    buf = io.StringIO()
    render(rec, console=Console(file=buf, width=80, color_system=None))
    lines = buf.getvalue().splitlines()

    def item(lead: str, text: str) -> list[str]:  # the lines of one item: its first and the indented ones after it
        first = next(i for i, line in enumerate(lines) if line.startswith(lead + text[:30]))
        rest = lines[first + 1 :]
        wrapped = rest[: next((i for i, line in enumerate(rest) if not line.startswith(" " * len(lead))), len(rest))]
        assert all(line[len(lead)] != " " for line in wrapped), wrapped  # under the text, not deeper
        assert all(line == line.rstrip() for line in (lines[first], *wrapped))  # not padded to the width
        assert " ".join([lines[first].removeprefix(lead), *(x.strip() for x in wrapped)]) == text.strip()
        return wrapped

    assert len(item("  1. ", f"cost: {rec.alternatives[0].cost}")) >= 1
    for w in rec.warnings:
        assert len(item("warning: ", w)) >= (len(w) > 80 - len("warning: ")), w
    assert len(item("warning: ", rec.warnings[-1])) == 2


def test_titles_fit_on_one_line_over_narrow_tables_in_80_columns(run):
    # the README's `memfit recommend --config tests/data/qwen3-0.6b.json --gpu RTX-4090 ... --explain` wrapped the
    # headline's title over its two short columns in 80 columns: "... 28 layers (predictor" / "0006)"
    import io

    from rich.console import Console

    from memfit.api import Recommendation
    from service.cli import render

    code, out, err = run(
        "recommend", "--config", str(QWEN3), "--gpu", "RTX-4090", "--micro-batch", "1", "--seq-len", "4096", "--json"
    )
    rec = Recommendation.model_validate(json.loads(out))
    assert code == EXIT_FITS, err
    buf = io.StringIO()
    render(
        rec, explain=True, label="tests/data/qwen3-0.6b.json", console=Console(file=buf, width=80, color_system=None)
    )
    lines = [line.strip() for line in buf.getvalue().splitlines()]
    assert max(len(line) for line in lines) <= 80
    for title in (
        f"memfit: tests/data/qwen3-0.6b.json — {rec.num_layers} layers (predictor {rec.model_version})",
        "memory over k (GiB; k = checkpointed layers)",
        f"breakdown at k={rec.k} (GiB, each rounded to 0.01)",
    ):
        assert title in lines, title


@pytest.mark.parametrize(
    "argv, flag, words",
    [
        (["--headroom", "2"], "--headroom", "must be a finite number in [0, 0.9]"),
        (["--gpu-memory-gib", "-1"], "--gpu-memory-gib", "must be a finite number in (0, 16384.0]"),
        (["--pipeline-parallel", "2"], "--pipeline-parallel", "= 2 exceeds cluster.gpu_count=1"),
        (["--context-parallel", "3"], "--context-parallel", "1*1*1*3 = 3 exceeds cluster.gpu_count=1"),
        (["--data-parallel", "2"], "--data-parallel", "2*1*1*1 = 2 exceeds cluster.gpu_count=1"),
        (["--frozen-layers", "40"], "--frozen-layers", "num_layers=28"),
        (["--frozen-layers", "4", "--lora-rank", "8"], "--frozen-layers", "full, LoRA or frozen"),
    ],
)
def test_out_of_range_values_name_the_flag_not_a_pydantic_dump(run, argv, flag, words):
    gpu = [] if "--gpu-memory-gib" in argv else ["--gpu", "L4"]
    code, out, err = run("recommend", "--config", str(QWEN3), *gpu, *BASE, *argv)
    assert code == EXIT_BAD_INPUT and out == ""
    assert flag in err and words in err
    assert "validation error for" not in err and "pydantic" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--micro-batch", "-2"],
            "--micro-batch (training.micro_batch_size): must be an integer in [1, 16384] (got -2)",
        ),
        (["--micro-batch", "0"], "--micro-batch (training.micro_batch_size): must be an integer in [1, 16384] (got 0)"),
        (["--seq-len", "-512"], "--seq-len (training.seq_len): must be an integer in [1, 4194304] (got -512)"),
        (["--gpus", "0"], "--gpus (cluster.gpu_count): must be an integer in [1, 131072] (got 0)"),
        (
            ["--gpus-per-node", "-8"],
            "--gpus-per-node (cluster.gpus_per_node): must be an integer in [1, 1024] (got -8)",
        ),
        (
            ["--tensor-parallel", "0"],
            ("--tensor-parallel (training.tensor_parallel_size): must be an integer in [1, 1024] (got 0)"),
        ),
        (["--lora-rank", "-16"], "--lora-rank (training.lora_rank): must be an integer in [1, 4096] (got -16)"),
        (
            ["--grad-accum", "0"],
            ("--grad-accum (training.gradient_accumulation_steps): must be an integer in [1, 65536] (got 0)"),
        ),
        (
            ["--moe-imbalance", "-1"],
            ("--moe-imbalance (training.moe_imbalance_factor): must be a finite number in [1.0, 4096.0] (got -1.0)"),
        ),
    ],
)
def test_negative_and_zero_numbers_name_the_flag_field_and_range(run, argv, expected):
    # `--micro-batch -2` was argparse's "argument --micro-batch: -2 must be >= 1": no field, no upper bound, and
    # worded unlike every other value out of range; the range is the request schema's, checked with the request
    args = dict(zip(BASE[::2], BASE[1::2]))
    args.update(zip(argv[::2], argv[1::2]))
    code, out, err = run("recommend", "--model", "gpt2", "--gpu", "L4", *(x for kv in args.items() for x in kv))
    assert code == EXIT_BAD_INPUT and out == ""
    assert err == f"memfit: error: {expected}\n"


def test_a_non_positive_timeout_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["recommend", "--model", "gpt2", "--gpu", "L4", *BASE, "--url", "http://127.0.0.1:9", "--timeout-s", "0"])
    assert info.value.code == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "memfit recommend: error: argument --timeout-s: must be a finite number of "
        "seconds > 0 (got 0)\nsee `memfit recommend --help`\n"
    )


@pytest.mark.parametrize("value", ["2", "-0.1"])
def test_a_value_beyond_either_bound_is_told_the_whole_range(run, value):
    # `--headroom 2` printed pydantic's one bound, "Input should be less than or equal to 0.9"; the range is the
    # request schema's (headroom_fraction: ge=0, le=0.9), worded as the service's 422 words it
    code, out, err = run("recommend", "--config", str(QWEN3), "--gpu", "L4", *BASE, "--headroom", value)
    assert code == EXIT_BAD_INPUT and out == ""
    assert err == (
        f"memfit: error: --headroom (headroom_fraction): must be a finite number in [0, 0.9] (got {float(value)})\n"
    )


def test_a_check_that_words_its_allowed_values_is_not_given_them_twice(run):
    # the request schema's own check names the allowed shardings in its message; the CLI (as the service's 422
    # detail) shows it as it is, without "(allowed: one of ['zero3', 'fsdp_full_shard'] ...)" after it
    code, out, err = run(
        "recommend",
        "--config",
        str(QWEN3),
        "--gpu",
        "L4",
        "--gpus",
        "2",
        *BASE,
        "--zero",
        "1",
        "--offload-parameters",
        "cpu",
        "--offload-optimizer",
        "cpu",
    )
    assert code == EXIT_BAD_INPUT and out == ""
    assert err == (
        "memfit: error: --zero/--sharding (training.sharding): offload_parameters='cpu' needs sharding in "
        "['zero3', 'fsdp_full_shard'] (or 'none' with data_parallel_size=1), got 'zero1'\n"
    )


def test_parallel_sizes_beyond_the_cluster_name_flag_field_and_allowed_range(run):
    # a new user's `--tensor-parallel 16` on 8 GPUs printed "... = 16 exceeds cluster.gpu_count=8" without the
    # allowed range that the service's 422 carries for the same request (service.errors.with_allowed words both)
    code, out, err = run(
        "recommend", "--config", str(QWEN3), "--gpu", "H100-80GB", "--gpus", "8", *BASE, "--tensor-parallel", "16"
    )
    assert code == EXIT_BAD_INPUT and out == ""
    # the rule was said twice: "... exceeds cluster.gpu_count=8 (allowed: such that data*tensor*pipeline*context
    # parallel size <= cluster.gpu_count=8)"; the allowed range is now the flag's, with the other sizes as given
    assert err == (
        "memfit: error: --tensor-parallel (training.tensor_parallel_size): data*tensor*pipeline*context "
        "parallel size = 1*16*1*1 = 16 exceeds cluster.gpu_count=8 (allowed: an integer in [1, 8])\n"
    )


def test_a_tensor_parallel_size_the_model_cannot_split_is_refused_before_the_predictor_loads(run, tmp_path):
    # `--tensor-parallel 3` was refused after the registry, store and predictor had loaded (10 s), and it was told
    # one rule of two (the KV heads'), then the other (the query heads') on the next try. The registry given here
    # is empty: the request's check (service.recommender.check_request) answers before it is opened
    (tmp_path / "no-registry").mkdir()
    code, out, err = run(
        "recommend",
        "--config",
        str(QWEN3),
        "--gpu",
        "H100-80GB",
        "--gpus",
        "4",
        *BASE,
        "--tensor-parallel",
        "3",
        "--registry",
        str(tmp_path / "no-registry"),
        registry=False,
    )
    assert code == EXIT_BAD_INPUT and out == ""
    assert err == (
        "memfit: error: --tensor-parallel (training.tensor_parallel_size): must be one of 1, 2, 4, 8, 16 "
        "(a divisor of num_attention_heads=16 that divides or is a multiple of num_key_value_heads=8), "
        "got 3\n"
    )
    # a size the model can split passes the check and reaches the registry, which holds no model (no answer)
    code, _, err = run(
        "recommend",
        "--config",
        str(QWEN3),
        "--gpu",
        "H100-80GB",
        "--gpus",
        "4",
        *BASE,
        "--tensor-parallel",
        "4",
        "--registry",
        str(tmp_path / "no-registry"),
        registry=False,
    )
    assert code == EXIT_NO_ANSWER and "tensor" not in err, err


def test_unreadable_configs_are_bad_input(run, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "nomodel.json").write_text(json.dumps({"hidden_size": 64}))
    for path, words in (
        (tmp_path / "bad.json", "is not a JSON file"),
        (tmp_path / "nomodel.json", "no 'model_type'"),
        (tmp_path / "missing.json", "does not exist"),
        (tmp_path, "has no config.json"),
    ):
        code, _, err = run("recommend", "--config", str(path), "--gpu", "L4", *BASE)
        assert code == EXIT_BAD_INPUT and f"--config: {path}" in err and words in err, err


def test_argparse_rejects_bad_flags_with_exit_2(capsys):
    for argv in (
        ["recommend", "--model", "gpt2", "--gpu", "B300", *BASE],
        ["recommend", "--model", "gpt2", "--gpu", "L4", "--micro-batch", "1.5", "--seq-len", "8"],
        ["recommend", "--model", "gpt2", "--config", "x.json", "--gpu", "L4", *BASE],
        ["recommend", "--model", "gpt2", *BASE],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "unknown GPU 'B300'" in err and "RTX-4090" in err and "'1.5' is not an integer" in err
    assert "not allowed with argument" in err and "one of the arguments --gpu --gpu-memory-gib is required" in err


def test_unknown_gpu_and_model_names_are_told_the_close_names(run, capsys):
    # `--gpu H100` listed all 13 GPUs; an unknown --model printed its close names as a Python list,
    # "close matches: ['llama2-13b', 'llama-3-8b', ...]", an alias and its catalog name both (memfit.errors.close_names)
    with pytest.raises(SystemExit) as info:
        main(["recommend", "--model", "gpt2", "--gpu", "H100", *BASE])
    assert info.value.code == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "memfit recommend: error: argument --gpu: unknown GPU 'H100'; close matches: "
        "H100-80GB, H100-94GB, H200; all GPUs: `memfit gpus`; or give "
        "--gpu-memory-gib\nsee `memfit recommend --help`\n"
    )
    code, out, err = run("recommend", "--model", "llama3", "--gpu", "H200", *BASE)
    assert code == EXIT_BAD_INPUT and out == ""
    assert err == (
        "memfit: error: --model: unknown model 'llama3'; close matches: llama-2-13b, llama-3-8b, "
        "llama-3-70b, tinyllama-1.1b; the catalog's names and aliases: `memfit models`; or pass --config "
        "PATH for a model outside the catalog\n"
    )


def test_the_service_tells_an_unknown_gpu_its_close_names():
    from memfit.api import gpu_memory_bytes
    from memfit.errors import InvalidConfiguration

    with pytest.raises(InvalidConfiguration) as info:
        gpu_memory_bytes("h100_80")
    assert str(info.value).endswith("got 'h100_80'; close matches: H100-80GB, A100-80GB, H100-94GB, A100-40GB")
    assert "[" not in str(info.value) and info.value.allowed.startswith("one of A100-40GB, A100-80GB, A10G, ")


def test_argparse_errors_are_short_and_point_to_help(capsys):
    # `--micro-batch -1` printed argparse's 23-line usage block of every flag above the one-line error
    with pytest.raises(SystemExit) as info:
        main(["recommend", "--model", "gpt2", "--gpu", "L4", "--micro-batch", "two", "--seq-len", "8"])
    assert info.value.code == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "memfit recommend: error: argument --micro-batch: 'two' is not an integer\nsee `memfit recommend --help`\n"
    )
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "memfit: error: the following arguments are required: {recommend,models,gpus}\nsee `memfit --help`\n"
    )
    # an unknown flag is the subcommand's error, pointing to that subcommand's help (it pointed to `memfit --help`)
    with pytest.raises(SystemExit) as info:
        main(["recommend", "--model", "gpt2", "--gpu", "L4", "--micro-batch", "1", "--seq-len", "8", "--bogus"])
    assert info.value.code == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "memfit recommend: error: unrecognized arguments: --bogus\nsee `memfit recommend --help`\n"
    )


def test_version_is_the_installed_distributions(capsys):
    # a new user's `memfit --version` answered "the following arguments are required: {recommend,models,gpus}"
    import importlib.metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"memfit {importlib.metadata.version('memfit')}\n"


def test_help_has_text_choices_defaults_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["recommend", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "--config PATH",
        "HF id",
        "(default: adamw_foreach)",
        (
            "--precision NAME training numerics; one of: "
            "fp32, amp_fp16, amp_bf16, bf16, bf16_fp32_master (default: bf16 for LoRA, a bf16 frozen base"
        ),
        "--zero {0,1,2,3}",
        "(default: block)",
        "RTX-4090",
        "exit codes",
        "503",
        "3 nothing fits",
    ):
        assert needle in text, needle


@pytest.mark.parametrize("argv", [["recommend", "--help"], ["--help"]])
def test_help_fits_the_terminal_width(capsys, monkeypatch, argv):
    # with COLUMNS=80, `memfit recommend --help` had lines of 84 to 121 columns: the choices of --precision,
    # --optimizer and --sharding as one unbreakable {a,b,...} word, and the exit codes kept as written (98)
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    # an exit code's wrapped lines hang under its text
    at = lines.index("    1  no answer: the service is unreachable, timed out or answered 5xx (e.g.")
    assert lines[at + 1] == "       503 while it loads), or no local model is registered"
    if argv[0] == "recommend":
        at = lines.index("  --optimizer NAME      optimizer; adamw is PyTorch's default")
        assert lines[at + 2] == "                        one of: adamw_foreach, adamw_fused, sgd_momentum,"


class _Stub(BaseHTTPRequestHandler):
    status = 503
    body: ClassVar[dict] = {"detail": "model loading"}

    def do_POST(self):  # http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        payload = json.dumps(self.body).encode()
        self.send_response(self.status)
        self.send_header("content-type", "application/problem+json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "status, body, code, words",
    [
        (503, {"detail": "model loading"}, EXIT_NO_ANSWER, "HTTP 503"),
        (422, {"detail": "training.seq_len=9999999 must be in [1, 4194304]"}, EXIT_BAD_INPUT, "seq_len=9999999"),
        # the service's problem+json field list (service/errors.py): each field named by its flag, as local errors are
        (
            422,
            {
                "detail": "invalid request",
                "errors": [
                    {
                        "field": "training.tensor_parallel_size",
                        "message": "must divide num_attention_heads = 12",
                        "allowed": "a divisor of 12",
                    },
                    {
                        "field": "cluster.gpu_count",
                        "message": "Input should be greater than or equal to 1",
                        "allowed": None,
                    },
                ],
            },
            EXIT_BAD_INPUT,
            (
                "--tensor-parallel (training.tensor_parallel_size): must divide num_attention_heads = 12 "
                "(allowed: a divisor of 12)\n--gpus (cluster.gpu_count): Input should be greater"
            ),
        ),
        # the service's 422 for `--tensor-parallel 16` on 8 GPUs (service.errors: InvalidConfiguration) reads as the
        # local answer does (test_parallel_sizes_beyond_the_cluster_...): was "...): training: data*tensor*..."
        (
            422,
            {
                "detail": "training: data*tensor*pipeline*context parallel size = 1*16*1*1 = 16 exceeds cluster.gpu_count=8",
                "errors": [
                    {
                        "field": "training.tensor_parallel_size",
                        "message": "training: data*tensor*pipeline*context "
                        "parallel size = 1*16*1*1 = 16 exceeds cluster.gpu_count=8",
                        "allowed": "an integer in [1, 8]",
                    }
                ],
            },
            EXIT_BAD_INPUT,
            (
                "memfit: error: --tensor-parallel (training.tensor_parallel_size): data*tensor*pipeline*context "
                "parallel size = 1*16*1*1 = 16 exceeds cluster.gpu_count=8 (allowed: an integer in [1, 8])\n"
            ),
        ),
    ],
)
def test_service_answers_map_to_documented_exit_codes(capsys, status, body, code, words):
    handler = type("Handler", (_Stub,), {"status": status, "body": body})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got = main(
            [
                "recommend",
                "--model",
                "gpt2",
                "--gpu",
                "L4",
                *BASE,
                "--url",
                f"http://127.0.0.1:{server.server_port}",
                "--timeout-s",
                "5",
            ]
        )
    finally:
        server.shutdown()
        server.server_close()
    assert got == code
    assert words in capsys.readouterr().err


def test_unreachable_service_exits_1(capsys):
    got = main(
        [
            "recommend",
            "--model",
            "gpt2",
            "--gpu",
            "L4",
            *BASE,
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--timeout-s",
            "2",
        ]
    )
    assert got == EXIT_NO_ANSWER
    assert "no answer" in capsys.readouterr().err


def test_models_and_gpus_lists(run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run("models")
    lines = {line.split()[0]: line for line in out.splitlines() if not line.startswith(" ")}
    assert code == EXIT_FITS and "mistral-7b" in lines["mistral-7b-v0.1"] and "llama-3.1-8b" in lines["llama-3-8b"]
    # long alias lists wrap under the aliases (up to 149 columns before)
    assert max(len(line) for line in out.splitlines()) <= 80
    assert any(line.startswith(" " * 25) and line[25] != " " for line in out.splitlines())
    code, out, _ = run("gpus")
    assert code == EXIT_FITS and f"RTX-4090     {GPUS['RTX-4090'] / 2**30:7.2f} GiB" in out
    sizes = [float(line.split()[1]) for line in out.splitlines()]
    assert sizes == sorted(sizes) and len(sizes) == len(GPUS)  # by memory (listed in the table's order before)


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert layer_ranges([]) == "" and layer_ranges([3]) == "3" and layer_ranges([4, 0, 2]) == "0, 2, 4"


def test_offload_flags_show_host_memory(run, monkeypatch, tmp_path):
    # the base's terms (Llama-3-8B bf16 + fp32 master, no offload) are stored as the CLI's tracer would store them:
    # tracing them here took 120 s of the suite beside other tests (tests/data/terms_llama3_8b_bf16_master.jsonl)
    from model.terms import TermsCache

    url = f"sqlite:///{tmp_path / 'telemetry.db'}"
    monkeypatch.setenv("MEMFIT_DB_URL", url)
    terms = TermsCache(url, shipped_dir=None)
    for line in (Path(__file__).parent / "data" / "terms_llama3_8b_bf16_master.jsonl").read_text().splitlines():
        entry = json.loads(line)
        terms.put(entry["key"], entry["terms"], entry["model_name"])
    code, out, err = run(
        "recommend",
        "--model",
        "llama-3-8b",
        "--gpu",
        "A100-80GB",
        "--micro-batch",
        "1",
        "--seq-len",
        "128",
        "--precision",
        "bf16_fp32_master",
        "--offload-optimizer",
        "cpu",
    )
    assert code == 0, err
    assert "host memory per node (offload)" in out and "179.49 GiB" in out  # 8.03e9 x 16 B x 1.5
    code, out, err = run(
        "recommend",
        "--model",
        "llama-3-8b",
        "--gpu",
        "A100-80GB",
        "--micro-batch",
        "1",
        "--seq-len",
        "128",
        "--offload-parameters",
        "cpu",
    )
    assert code == 2 and "offload_optimizer='cpu'" in err


def test_parameters_per_gpu_says_what_zero3_stores(run, monkeypatch):
    # a new user read "parameters per GPU 8.030 B" under ZeRO-3 over 8 GPUs as the whole model on every GPU
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run(
        "recommend", "--model", "llama-3-8b", "--gpu", "H100-80GB", "--gpus", "8", "--zero", "3", *BASE
    )
    assert code == EXIT_FITS, err
    assert "1.004 B stored between uses (zero3: 1/8 each), 8.030 B gathered while in use" in out
    # with parameter offload the shards are in host memory (a new user read "1.004 B stored" against a breakdown of
    # parameters_bytes 0)
    offload = ("--offload-optimizer", "cpu", "--offload-parameters", "cpu", "--json")
    code, out, err = run(
        "recommend", "--model", "llama-3-8b", "--gpu", "H100-80GB", "--gpus", "8", "--zero", "3", *BASE, *offload
    )
    assert json.loads(out)["breakdown"]["parameters_bytes"] == 0, err
    code, out, err = run(
        "recommend", "--model", "llama-3-8b", "--gpu", "H100-80GB", "--gpus", "8", "--zero", "3", *BASE, *offload[:-1]
    )
    assert "none stored between uses (offloaded to the host), 8.030 B in all, gathered a unit at a time" in out
    assert "stored between uses (zero3" not in out


def test_explain_says_where_the_gradients_are_while_they_build_up(run, monkeypatch):
    # a new user read "gradients 0.00" at a peak in backward (here the head's) as "no gradients": they are
    # building up layer by layer there and model.curve.breakdown counts them with the activations
    monkeypatch.setenv("COLUMNS", "200")
    argv = ("recommend", "--config", str(QWEN3), "--gpu", "RTX-4090", "--micro-batch", "1", "--seq-len", "4096")
    code, out, err = run(*argv, "--json")
    rec = json.loads(out)
    assert code == EXIT_FITS and rec["peak_phase"] == "bwd.head" and rec["breakdown"]["gradients_bytes"] == 0, err
    code, out, err = run(*argv, "--explain")
    assert "gradients (building up layer by layer: counted with activations)" in out
    assert "activations (with the gradients built so far)" in out

    # the parts add up to the point prediction, and the margin and the overhead lead from it to the headline's
    # "upper bound + overhead" (a new user summed the parts and the overhead, 22.14, and matched neither headline
    # figure, 19.29 and 22.23: the 0.10 GiB margin between the point and the bound was printed nowhere)
    def row(label: str) -> str:  # the figure at the end of the first line holding the label ("GiB" dropped)
        return next(line for line in out.splitlines() if label in line).strip("│ ").removesuffix(" GiB").split()[-1]

    gib = 2**30
    margin = rec["upper_bound_bytes"] - rec["predicted_peak_bytes"]
    assert sum(rec["breakdown"].values()) == rec["predicted_peak_bytes"]
    assert rec["upper_bound_bytes"] + rec["overhead"]["total_bytes"] == rec["total_upper_bytes"]
    assert row("predicted peak: the point prediction, the parts' sum") == f"{rec['predicted_peak_bytes'] / gib:.2f}"
    assert (
        row(f"+ margin to the upper bound ({margin / rec['predicted_peak_bytes']:.1%} of the point)")
        == f"{margin / gib:.2f}"
    )
    assert margin > 0 and row("+ margin to the upper bound") != "0.00"
    assert row("+ overhead: CUDA context") == f"{rec['overhead']['total_bytes'] / gib:.2f}"
    # the fit test as the allowance makes it: the default allocator's largest request, the fp32 logits, kept free
    assert rec["fit_method"] == "allowance" and rec["allocator_room_bytes"] == 4 * 4096 * 151936
    room = rec["allocator_room_bytes"] / gib
    total = row(f"= upper bound + overhead (fits when it + the largest request, {room:.2f}, <= usable")
    assert total == f"{rec['total_upper_bytes'] / gib:.2f}" == row("│ upper bound + overhead ")
    assert "breakdown at k=" in out and "(GiB, each rounded to 0.01)" in out
    # the chart marks the limit the bars are tested against, not only usable memory (a new user read bars left of
    # "usable" marked "no" as a contradiction)
    limit = (rec["usable_bytes"] - rec["allocator_room_bytes"]) / gib
    assert f"┆ = usable - the largest request ({room:.2f}) = {limit:.2f} GiB: a fitting bar ends left of it" in out
    assert all("┆" in line for line in out.splitlines() if line.startswith("k=") and "█" in line)


def test_readme_commands_parse_into_valid_requests():
    # the README's examples (--precision, --optimizer, --attention, --gpus among them) must be commands memfit
    # takes: every flag and choice parsed by the real parser and every request valid, as a user pastes them
    import re
    import shlex

    from service.cli import build_parser, request_from_args

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL)
    commands = [
        line.split("#")[0]
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("memfit recommend --") and "..." not in line
    ]
    assert len(commands) >= 5
    flags = set()
    for line in commands:
        argv = shlex.split(line)[1:]
        req = request_from_args(build_parser().parse_args(argv))
        flags.update(a for a in argv if a.startswith("--"))
        if "--optimizer" in argv and argv[argv.index("--optimizer") + 1] == "adamw":
            assert req.training.optimizer.value == "adamw_foreach"
    assert {"--precision", "--optimizer", "--attention", "--gpus"} <= flags


def test_readme_curl_bodies_are_valid_requests():
    # a new user had to read /openapi.json to learn /predict's body: the README now shows one; each curl body there
    # must be a request the service takes
    import json
    import re

    from memfit.api import PredictRequest, RecommendRequest

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    calls = re.findall(r"curl -s -X POST http://[^/]+/(\w+) .*?-d '(.*?)'", readme, flags=re.DOTALL)
    kinds = {path: [] for path in ("recommend", "predict")}
    for path, body in calls:
        kinds[path].append(
            {"recommend": RecommendRequest, "predict": PredictRequest}[path].model_validate(json.loads(body))
        )
    assert kinds["recommend"] and kinds["predict"] and kinds["predict"][0].items[0].k == 16


def test_fits_column_is_the_test_that_chose_k(run, monkeypatch):
    """A new user's qwen3-0.6b on an RTX-4090: the table said k = 9 fits (the allocated bound against usable
    memory) while the answer was k = 20 (the simulated caching allocator). Both now read one test."""
    args = ("recommend", "--config", str(QWEN3), "--gpu", "RTX-4090", "--micro-batch", "1", "--seq-len", "4096")
    code, out, err = run(*args, "--json")
    assert code == EXIT_FITS, err
    rec = json.loads(out)
    fits = {c["k"]: c["fits"] for c in rec["curve"]}
    assert min(k for k, f in fits.items() if f) == rec["k"]
    if rec["fit_method"] == "simulated":  # allocated bounds below usable memory that the allocator refuses
        assert any(c["total_upper_bytes"] <= rec["usable_bytes"] and not c["fits"] for c in rec["curve"])
    monkeypatch.setenv("COLUMNS", "120")
    code, out, _ = run(*args)
    lines = out.splitlines()
    start = [line.strip() for line in lines].index("memory over k (GiB; k = checkpointed layers)")
    header = [c.strip() for c in lines[start + 2].strip("┃").split("┃")]
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in lines[start + 4 : end]]
    col = header.index("fits")
    assert rows and all(r[col] == ("yes" if fits[int(r[0])] else "no") for r in rows), rows


def _serve(answers: list[dict]):
    """A stand-in service answering each POST with the next of ``answers`` (the last one repeated)."""

    class Handler(_Stub):
        status = 200

        def do_POST(self):
            type(self).body = answers.pop(0) if len(answers) > 1 else answers[0]
            super().do_POST()

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_url_asks_again_while_the_answer_is_pending_and_says_so(capfd):
    """Helper 37: ``--url`` waited 16.6 s for a T4 answer with nothing on stderr, and the wait could not be set."""
    final = _serve(
        [
            answer(k=7, layers=list(range(7)), num_layers=24, pending=["terms", "allocation streams"]),
            answer(k=11, layers=list(range(11)), num_layers=24, pending=["allocation streams"]),
            answer(k=10, layers=list(range(10)), num_layers=24, pending=[]),
        ]
    )
    never = _serve([answer(k=7, layers=list(range(7)), num_layers=24, pending=["terms"])])
    try:
        ask = ["recommend", "--model", "gpt2", "--gpu", "L4", *BASE, "--url"]
        got = main([*ask, f"http://127.0.0.1:{final.server_port}", "--json"])
        out, err = capfd.readouterr()
        assert got == EXIT_FITS and json.loads(out)["k"] == 10
        assert err.count("the service is still") == 1
        assert (
            "memfit: the service is still tracing this configuration with the GPU's CUDA semantics (queued, running, "
            "or waiting for room in its queue) and recording the step's allocation streams for the fit decision "
            "(queued or running); asking again for up to 120 s\n"
        ) in err
        # never final: exit 1 after --final-wait-s, naming the wait and what the service still works out
        got = main([*ask, f"http://127.0.0.1:{never.server_port}", "--final-wait-s", "1"])
        err = capfd.readouterr().err
        assert (
            got == EXIT_NO_ANSWER
            and (
                "the answer was not final after 1 s (the service is still tracing this configuration with the GPU's "
                "CUDA semantics (queued, running, or waiting for room in its queue); its interim k = 7 can be too "
                "small): ask again later, or raise --final-wait-s"
            )
            in err
        )
        # 0: the first answer as it is
        got = main([*ask, f"http://127.0.0.1:{never.server_port}", "--final-wait-s", "0", "--json"])
        out, err = capfd.readouterr()
        assert got == EXIT_FITS and json.loads(out)["pending"] == ["terms"]
        assert "memfit: this answer is not final: the service is still tracing this configuration with" in err
    finally:
        for server in (final, never):
            server.shutdown()
            server.server_close()
    with pytest.raises(SystemExit) as exit_:
        main([*ask, "http://127.0.0.1:9", "--final-wait-s", "-1"])
    assert exit_.value.code == EXIT_BAD_INPUT
    assert "--final-wait-s: must be a finite number of seconds >= 0 (got -1)" in capfd.readouterr().err


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--final-wait-s", "5"], "--final-wait-s applies"),
        (["--timeout-s", "2", "--final-wait-s", "0"], "--timeout-s and --final-wait-s apply"),
    ],
)
def test_service_only_flags_without_url_are_refused_not_ignored(capfd, flags, named):
    """``--timeout-s`` and ``--final-wait-s`` shape how the service is asked; the local answer asks none, so without
    ``--url`` they are bad input (exit 2, naming them), not silently ignored."""
    with pytest.raises(SystemExit) as exit_:
        main(["recommend", "--model", "gpt2", "--gpu", "L4", *BASE, *flags])
    assert exit_.value.code == EXIT_BAD_INPUT
    err = capfd.readouterr().err
    assert f"memfit recommend: error: {named} with --url only" in err and "see `memfit recommend --help`" in err


@pytest.mark.parametrize(
    "url,why",
    [
        ("notaurl", "url='notaurl' must be an http:// or https:// URL with a host"),
        ("http://127.0.0.1:99999", "url='http://127.0.0.1:99999': port 99999 must be in [1, 65535]"),
    ],
)
def test_a_bad_url_is_bad_input_not_an_internal_error(capfd, url, why):
    """Helper 40: ``--url notaurl`` printed "internal error: ValueError ... please report it" (exit 4), and an
    out-of-range port was "unreachable" (exit 1)."""
    with pytest.raises(SystemExit) as exit_:
        main(["recommend", "--model", "gpt2", "--gpu", "L4", *BASE, "--url", url])
    assert exit_.value.code == EXIT_BAD_INPUT
    assert f"memfit recommend: error: argument --url: {why}" in capfd.readouterr().err


def test_a_registry_folder_that_does_not_exist_is_named(capfd, tmp_path):
    """Helper 40: ``--registry /tmp/nonexistent`` said "no model registered (train one ...)"."""
    with pytest.raises(SystemExit) as exit_:
        main(["recommend", "--model", "gpt2", "--gpu", "L4", *BASE, "--registry", str(tmp_path / "nope")])
    assert exit_.value.code == EXIT_BAD_INPUT
    assert f"argument --registry: '{tmp_path / 'nope'}' is not a folder (it does not exist)" in capfd.readouterr().err

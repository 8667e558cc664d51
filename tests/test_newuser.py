"""Faults a new user hit by following the README (issue 9 settings posed through the CLI and the HTTP API)."""

from __future__ import annotations

import json

import pytest

from memfit.schema import ModelSpec, Optimizer, Precision, TrainingConfig
from model.offload import host_bytes_per_rank, host_memory_bytes
from tests.helpers import TINY_LLAMA


def _llama_8b_spec() -> ModelSpec:
    return ModelSpec(
        architecture="llama",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        total_params=8_030_261_248,
        trainable_params=8_030_261_248,
    )


@pytest.mark.parametrize("optimizer", list(Optimizer))
def test_offload_host_memory_answers_for_every_optimizer(optimizer):
    # `memfit recommend ... --optimizer lion --offload-optimizer cpu` died with KeyError (HTTP 500, CLI
    # "error: lion" with exit 2), and so did every 8-bit request whose alternatives try optimizer offload.
    spec = _llama_8b_spec()
    tr = TrainingConfig(
        micro_batch_size=1,
        seq_len=128,
        precision=Precision.BF16_FP32_MASTER,
        optimizer=optimizer,
        offload_optimizer="cpu",
    )
    per_rank = host_bytes_per_rank(spec, tr)
    # the host keeps the optimizer states, the fp32 master copy and the fp32 gradient copy (4 + 4 B)
    states = {
        Optimizer.ADAMW_FOREACH: 8,
        Optimizer.ADAMW_FUSED: 8,
        Optimizer.SGD_MOMENTUM: 4,
        Optimizer.ADAFACTOR: 0,
        Optimizer.LION: 4,
        Optimizer.ADAMW_8BIT: 2 + 8 / 256,
        Optimizer.PAGED_ADAMW_8BIT: 2 + 8 / 256,
    }[optimizer]
    assert per_rank == pytest.approx(spec.trainable_params * (states + 8), abs=1)
    assert host_memory_bytes(spec, tr) >= int(4 * spec.total_params * 1.5)


def test_cli_does_not_call_an_internal_error_bad_input(monkeypatch, capsys):
    # The lion + offload KeyError above reached the user as "memfit: error: lion" with exit 2 ("bad input"),
    # although nothing was wrong with the input: an internal fault must not be reported as the user's mistake.
    from service import cli

    def broken(req, registry):
        raise KeyError("lion")

    monkeypatch.setattr(cli, "recommend_local", broken)
    argv = ["recommend", "--model", "gpt2", "--gpu", "T4", "--micro-batch", "1", "--seq-len", "128"]
    assert cli.main(argv) == cli.EXIT_INTERNAL  # issue 28: exit 4, told as memfit's fault (was a raw traceback)
    assert capsys.readouterr().err.startswith("memfit: internal error: KeyError: 'lion'")
    # a real bad input still exits 2 and names the flag
    assert cli.main(["recommend", "--model", "no-such-model", *argv[3:]]) == cli.EXIT_BAD_INPUT
    assert "--model" in capsys.readouterr().err


def test_cli_config_keeps_the_quantization_config(tmp_path):
    # `memfit recommend --config qlora-config.json --lora-rank 8 ...` answered for a bf16 base: the config's
    # quantization_config was dropped with the memory-irrelevant keys, although --quantization's help says
    # its default is "the config's quantization_config".
    import json

    from service.cli import build_parser, request_from_args

    cfg = json.loads((__import__("pathlib").Path(__file__).parent / "data" / "qwen3-0.6b.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    a = build_parser().parse_args(
        [
            "recommend",
            "--config",
            str(path),
            "--lora-rank",
            "8",
            "--gpu",
            "T4",
            "--micro-batch",
            "1",
            "--seq-len",
            "128",
        ]
    )
    req = request_from_args(a)
    assert req.model["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    assert req.training.resolved_quantization(req.model["quantization_config"]).value == "nf4_double_quant"
    assert "architectures" not in req.model  # the rest is still cleaned


def test_cli_lora_targets(capsys):
    # The public cases pose LoRA on q,k,v,o (Mixtral) or on every linear layer (QLoRA), and the CLI refuses
    # Qwen-MoE LoRA with "training.lora_target_modules: must be a list of module names", but had no flag to
    # give them: the answer was always for PEFT's default targets.
    from service.cli import EXIT_BAD_INPUT, build_parser, main, request_from_args

    base = ["recommend", "--model", "qwen2.5-0.5b", "--gpu", "T4", "--micro-batch", "1", "--seq-len", "128"]
    a = build_parser().parse_args([*base, "--lora-rank", "16", "--lora-targets", "q_proj, k_proj,v_proj,o_proj"])
    assert request_from_args(a).training.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert main([*base, "--lora-targets", "q_proj"]) == EXIT_BAD_INPUT
    assert "--lora-targets: needs --lora-rank" in capsys.readouterr().err


def test_422_detail_names_the_field_once():
    # POST /recommend with offload_parameters='cpu' alone answered
    # "training.offload_optimizer: training.offload_optimizer: offload_parameters='cpu' needs offload_optimizer='cpu'
    # (allowed: 'cpu') (allowed: 'cpu' when offload_parameters='cpu')"; an unknown GPU listed the GPUs twice.
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from memfit.api import RecommendRequest
    from service.errors import _validation_errors, validation_detail

    body = {
        "model": "llama-3-8b",
        "training": {"micro_batch_size": 1, "seq_len": 512, "offload_parameters": "cpu"},
        "cluster": {"gpu": "B200"},
    }
    with pytest.raises(ValidationError) as err:
        RecommendRequest.model_validate(body)
    exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])
    detail = validation_detail(_validation_errors(exc, RecommendRequest))
    assert detail.count("training.offload_optimizer") == 1 and detail.count("(allowed:") == 1, detail
    # the GPUs listed once, by name, not as a Python list (memfit.api.gpu_memory_bytes), and the close one named
    assert detail.count("cluster.gpu") == 1 and detail.count("H100-80GB") == 1 and "['" not in detail, detail
    assert detail.endswith("got 'B200'; close matches: H200"), detail
    # a plain pydantic error keeps its field prefix and its allowed range
    with pytest.raises(ValidationError) as err:
        RecommendRequest.model_validate(
            {**body, "training": {"micro_batch_size": 0, "seq_len": 512}, "cluster": {"gpu": "T4"}}
        )
    exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])
    assert validation_detail(_validation_errors(exc, RecommendRequest)).startswith(
        "training.micro_batch_size: Input should be greater than or equal to 1 (allowed: an integer in [1, 16384])"
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        # a check inside the request schema's validator: was "training: offload_optimizer: offload_parameters=..."
        # (now with the field, as every CLI field error names it: service.cli.flag_problem)
        (
            ["--offload-parameters", "cpu"],
            (
                "memfit: error: --offload-optimizer (training.offload_optimizer): "
                "offload_parameters='cpu' needs offload_optimizer='cpu' (allowed: 'cpu')"
            ),
        ),
        # a check of the recommender: was "training.sharding: must be ..." without the flag
        (
            ["--zero", "3"],
            ("memfit: error: --zero/--sharding (training.sharding): must be 'none' when data_parallel_size is 1"),
        ),
        # the same, with a message that names the section: was "... (training.data_parallel_size): training: data*..."
        # and the flag the user raised (was --data-parallel, which they had not passed)
        (
            ["--gpus", "2", "--pipeline-parallel", "4"],
            (
                "memfit: error: --pipeline-parallel (training.pipeline_parallel_size"
                "): data*tensor*pipeline*context parallel size = 1*1*4*1 = 4 "
                "exceeds"
            ),
        ),
    ],
)
def test_cli_errors_name_the_flag(small_registry, capsys, argv, expected):
    from service.cli import EXIT_BAD_INPUT, main

    code = main(
        [
            "recommend",
            "--model",
            "llama-3-8b",
            "--gpu",
            "A100-80GB",
            "--micro-batch",
            "1",
            "--seq-len",
            "128",
            "--registry",
            str(small_registry.root),
            *argv,
        ]
    )
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and err.startswith(expected), err


def test_trace_terms_ignores_pipeline_and_context_parallel():
    # `memfit recommend --model llama-3.2-1b --gpus 4 --tensor-parallel 2 --pipeline-parallel 2 ...` (and
    # --context-parallel, or any PP/CP configuration whose base was not traced yet) answered provisionally:
    # "tracing it failed (ValueError: the collector runs pipeline_parallel_size=1 and context_parallel_size=1
    # only ...)". The terms key leaves PP and CP out (model.parallel composes them), so the trace must too.
    import json

    from tracer.phases import trace_terms

    tiny = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "vocab_size": 2048,
        "tie_word_embeddings": False,
    }
    points = [(2, 64), (2, 16), (2, 32), (4, 16), (4, 64)]  # as in tests/test_parallel.py
    base = TrainingConfig(micro_batch_size=1, seq_len=64, tensor_parallel_size=2)
    parallel = TrainingConfig(
        micro_batch_size=1,
        seq_len=64,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        context_parallel_size=2,
        num_micro_batches=4,
    )
    import torch.distributed as dist

    was_initialized = dist.is_initialized()
    a, b = (json.dumps(trace_terms(tiny, t, points=points).to_json()["coef"], sort_keys=True) for t in (base, parallel))
    assert a == b
    # the TP trace's fake process group is gone: describe() in this process reads no world size of 2
    assert dist.is_initialized() == was_initialized


def test_a_trace_inside_a_real_process_group_refuses_instead_of_destroying_it():
    # a user's training process with its own gloo/nccl group asks for a sharded trace in-process: the fake group the
    # trace needs would replace (destroy) the job's group, so the trace refuses and leaves the group as it was
    import torch.distributed as dist

    from tracer.collect import measure

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        training = TrainingConfig(micro_batch_size=1, seq_len=32, sharding="fsdp_full_shard", data_parallel_size=2)
        with pytest.raises(RuntimeError, match="real 'gloo' group of world size 1; trace in another process"):
            measure(TINY_LLAMA, training, device="fake")
        assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"offload_optimizer": "disk"}, "offload_optimizer"),  # was "ValueError: 'disk' is not a valid Offload"
        ({"offload_parameters": "gpu"}, "offload_parameters"),
        ({"sharding": "zero4", "gpu_count": 2}, "sharding"),  # was "ValueError: 'zero4' is not a valid Sharding"
    ],
)
def test_describe_names_the_argument_and_allowed_values(kwargs, field):
    import torch

    import memfit
    from memfit.errors import InvalidConfiguration

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(InvalidConfiguration) as err:
        memfit.describe(
            model,
            micro_batch_size=1,
            seq_len=128,
            gpu="T4",
            architecture={
                "family": "llama",
                "num_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 256,
            },
            **kwargs,
        )
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(f"{field}: must be one of [") and (
        "'cpu'" in str(err.value) or "'zero3'" in str(err.value)
    ), str(err.value)


def test_cli_stderr_has_no_bitsandbytes_cpu_kernel_notice():
    # Every `memfit recommend` whose answer lists a LoRA alternative ended with
    # "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure
    # you already `pip install kernels` ..." on stderr (bitsandbytes' import, through PEFT), advice that has
    # nothing to do with the answer.
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "recommend",
            "--model",
            "llama-3-8b",
            "--gpu",
            "H100-80GB",
            "--gpus",
            "8",
            "--zero",
            "3",
            "--micro-batch",
            "2",
            "--seq-len",
            "8192",
            "--json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "kernels" not in done.stderr, done.stderr
    # stdout is the answer alone, read at the file descriptor (C-level library output included): one JSON document.
    # The fake process group line a new user took for library chatter is the answer's own note on how the
    # sharding was traced, inside that document, worded for the user
    rec = json.loads(done.stdout)
    assert rec["warnings"][0] == (
        "zero3 over 8 data-parallel ranks: rank 0's memory, traced in one process over "
        "torch's fake process group of 8 ranks (no communication is run)"
    )
    assert done.stderr == ""


def test_parameters_per_rank_counts_one_expert_parallel_shard():
    # `memfit recommend --model mixtral-8x7b --gpus 8 --expert-parallel 4 ...` printed "parameters per GPU
    # 46.703 B", the whole model, although each rank holds 2 of the 8 experts of every layer (the curve itself
    # is traced on that shard).
    from memfit.api import RecommendRequest
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry().load()
    rec = Recommender(loaded.estimator, loaded.version).recommend(
        RecommendRequest.model_validate(
            {
                "model": "mixtral-8x7b",
                "training": {"micro_batch_size": 1, "seq_len": 512, "precision": "bf16", "expert_parallel_size": 4},
                "cluster": {"gpu": "H200", "gpu_count": 8},
            }
        )
    )
    experts = 32 * 8 * 3 * 4096 * 14336  # layers x experts x (w1, w2, w3) x hidden x FFN
    rest = rec.parameters_per_rank - experts // 4
    assert rest == pytest.approx(46_702_792_704 - experts, rel=1e-3)


def test_exit_code_survives_a_reader_that_leaves():
    # `memfit recommend ... | head -1` under `set -o pipefail` exited 1 instead of 3 (nothing fits): rich's console
    # exits with status 1 on a broken pipe
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "recommend",
        "--model",
        "llama-3-8b",
        "--gpu",
        "A100-80GB",
        "--precision",
        "bf16_fp32_master",
        "--micro-batch",
        "1",
        "--seq-len",
        "128",
    ]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        proc.stdout.read(10)
        proc.stdout.close()
        assert proc.wait(timeout=300) == 3


def test_lists_survive_a_reader_that_leaves():
    # `memfit gpus | head -2` printed a BrokenPipeError traceback after the two lines
    import subprocess
    import sys

    for command in ("gpus", "models"):
        with subprocess.Popen(
            [sys.executable, "-m", "service.cli", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as proc:
            proc.stdout.read(10)
            proc.stdout.close()
            assert proc.wait(timeout=120) == 0
            assert b"Traceback" not in proc.stderr.read(), command


def test_adamw_is_pytorchs_default_adamw_the_foreach_one(small_registry, capsys):
    # `--optimizer adamw` was refused ("invalid choice: 'adamw'"): a user naming PyTorch's torch.optim.AdamW() gets
    # what it runs on CUDA, the foreach implementation (torch/optim/adam.py: use_fused=False, foreach on CUDA), taken
    # at the edge as the one member adamw_foreach (no second name for the same optimizer inside)
    from memfit.api import TrainingIn
    from memfit.schema import Optimizer
    from service.cli import main

    assert (
        TrainingIn.model_validate({"micro_batch_size": 1, "seq_len": 8, "optimizer": "adamw"}).optimizer
        is Optimizer.ADAMW_FOREACH
    )
    assert "adamw" not in {o.value for o in Optimizer}
    # the request schema lists the alias, so a client that validates against /openapi.json may send it (helper 41)
    schema = TrainingIn.model_json_schema()["properties"]["optimizer"]
    assert schema["enum"] == [*(o.value for o in Optimizer), "adamw"] and schema["default"] == "adamw_foreach"
    answers = {}
    for name in ("adamw", "adamw_foreach"):
        code = main(
            [
                "recommend",
                "--model",
                "gpt2",
                "--gpu",
                "A100-80GB",
                "--micro-batch",
                "1",
                "--seq-len",
                "1024",
                "--optimizer",
                name,
                "--json",
                "--registry",
                str(small_registry.root),
            ]
        )
        answers[name] = json.loads(capsys.readouterr().out)
        assert code == 0
    assert answers["adamw"]["training"]["optimizer"] == "adamw_foreach"
    assert answers["adamw"]["curve"] == answers["adamw_foreach"]["curve"]
    with pytest.raises(SystemExit):
        main(["recommend", "--help"])
    assert "adamw is PyTorch's default torch.optim.AdamW, which runs adamw_foreach on CUDA" in " ".join(
        capsys.readouterr().out.split()
    )


def test_bf16_on_a_board_without_bf16_tensor_cores_is_said():
    # a new user got an amp_bf16 answer (the default) for a T4 and a V100 without a word: neither has bf16 tensor cores
    from memfit.api import RecommendRequest
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry().load()
    recommender = Recommender(loaded.estimator, loaded.version)

    def warned(gpu, **training):
        body = {"model": "llama-3.2-1b", "training": {"micro_batch_size": 1, "seq_len": 1024, **training}}
        rec = recommender.recommend(RecommendRequest.model_validate({**body, "cluster": {"gpu": gpu}}))
        return [w for w in rec.warnings if "bfloat16" in w]

    (t4,) = warned("T4")
    assert t4.startswith("T4 (compute capability 7.5) has no bfloat16 tensor cores") and "amp_fp16" in t4
    (v100,) = warned("V100-32GB", precision="bf16_fp32_master")
    assert "7.0" in v100 and "the answer is for bf16_fp32_master as asked" in v100
    # a DeepSpeed fp16 job is described as bf16_fp32_master (same states): the warning says how the answer reads then
    assert "DeepSpeed's or Megatron's fp16" in v100 and "errs high" in v100
    (pure,) = warned("V100-32GB", precision="bf16")
    assert "the answer is for bf16 as asked" in pure and "fp16" not in pure
    assert warned("T4", precision="amp_fp16") == [] and warned("A100-80GB") == []


def test_a_misspelt_or_missing_field_is_named_with_what_is_allowed():
    # a new user's "shardng" got pydantic's "Extra inputs are not permitted" and a missing section "Field required",
    # neither with the allowed key the README promises for every 422
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from memfit.api import RecommendRequest
    from service.errors import _validation_errors

    def errors(body):
        with pytest.raises(ValidationError) as err:
            RecommendRequest.model_validate(body)
        exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])
        return {e["field"]: e for e in _validation_errors(exc, RecommendRequest)}

    body = {"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 128, "shardng": "zero3"}}
    found = errors({**body, "cluster": {"gpu": "L4"}, "headroom": 0.1})
    assert found["training.shardng"]["message"] == "unknown field; did you mean 'sharding'?"
    assert "'sharding'" in found["training.shardng"]["allowed"] and "'seq_len'" in found["training.shardng"]["allowed"]
    assert found["headroom"]["message"] == "unknown field; did you mean 'headroom_fraction'?"
    missing = errors({"model": "gpt2"})
    assert missing["training"]["message"] == "required" and "'micro_batch_size'" in missing["training"]["allowed"]
    assert missing["cluster"]["message"] == "required" and "'gpu'" in missing["cluster"]["allowed"]
    no_model = errors({"training": {"micro_batch_size": 1, "seq_len": 128}, "cluster": {"gpu": "L4"}})
    assert no_model["model"]["allowed"].startswith("catalog name")
    # a value of no member of a union: one error at the field, not one per member ("model.str: ...; model.dict...")
    null_model = errors({"model": None, "training": body["training"] | {"shardng": "none"}, "cluster": {"gpu": "L4"}})
    assert null_model["model"]["message"] == "wrong type (got null)" and not any(
        f.startswith("model.") for f in null_model
    )
    assert null_model["model"]["allowed"].startswith("catalog name")
    null_cluster = errors({"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 128}, "cluster": None})
    assert null_cluster["cluster"]["message"] == "must be an object (got null)"
    assert "'gpu'" in null_cluster["cluster"]["allowed"]


def test_a_sequence_beyond_the_trained_rope_positions_is_said():
    # a new user asked phi-3-mini-4k (4,096 positions, no rope_scaling) at 65,536 tokens and got no word of it
    from memfit.api import RecommendRequest
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry().load()
    recommender = Recommender(loaded.estimator, loaded.version)

    def warned(seq_len):
        body = {
            "model": "phi-3-mini-4k",
            "training": {"micro_batch_size": 1, "seq_len": seq_len},
            "cluster": {"gpu": "H200"},
        }
        rec = recommender.recommend(RecommendRequest.model_validate(body))
        return [w for w in rec.warnings if "positions the model was trained on" in w]

    (beyond,) = warned(65536)
    assert beyond.startswith("seq_len=65536 is beyond the 4096 positions")
    assert warned(4096) == []

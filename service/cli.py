"""``memfit`` terminal command: which layers to activation-checkpoint, for any model.

    memfit recommend --model llama-3-8b --gpu H100-80GB --gpus 8 --zero 3 --micro-batch 2 --seq-len 8192
    memfit recommend --config path/to/config.json --gpu RTX-4090 --micro-batch 1 --seq-len 4096
    memfit recommend --config path/to/model_folder/ ...          # the folder's config.json
    memfit recommend --model Qwen/Qwen3-0.6B ...                 # a HF id in the local HF cache (offline)
    memfit recommend ... --explain                               # + breakdown and the curve as a chart
    memfit recommend ... --json                                  # the answer as JSON (bytes)
    memfit recommend ... --url http://127.0.0.1:8000             # ask a running service

The model is a catalog name (``memfit models``), a HF id whose ``config.json`` is in the local HF cache
(never downloaded), or ``--config`` (a ``config.json`` or a folder holding one). A config is sent as the
request's model; the answer comes from :class:`service.recommender.Recommender` over the local model
registry, or from the service at ``--url`` (:class:`memfit.Client`, strict). Sizes stay in bytes until
printed (GiB, 1 GiB = 2**30 bytes); ``--json`` prints bytes.

Exit codes:
    0  a k fits: the plan is printed
    1  no answer: the service is unreachable, timed out or answered 5xx (e.g. 503 while it loads),
       or no local model is registered
    2  bad input the user can fix: unknown model, unreadable config, a value out of range (named with its
       flag and the allowed range), or the service rejected the request (4xx)
    3  nothing fits at any k: the alternatives are printed
    4  internal error: a fault of memfit, not of the input ("memfit: internal error: <type>: <message>")
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from memfit.alloc_conf import alloc_conf_from_env
from memfit.api import FINAL_WAIT_S, GPUS, OPTIMIZER_ALIASES, Recommendation, RecommendRequest, TrainingIn
from memfit.errors import MemfitError, close_names
from memfit.schema import (
    Attention,
    CheckpointImpl,
    Offload,
    Optimizer,
    PipelineSchedule,
    Precision,
    Quantization,
    Sharding,
)

GIB = 1 << 30
EXIT_FITS, EXIT_NO_ANSWER, EXIT_BAD_INPUT, EXIT_NO_FIT, EXIT_INTERNAL = 0, 1, 2, 3, 4
#: ``--timeout-s`` when not given: seconds per request to the service
TIMEOUT_S = 10.0
ZERO = {0: Sharding.NONE, 1: Sharding.ZERO1, 2: Sharding.ZERO2, 3: Sharding.ZERO3}

#: request field -> the flag that sets it, so errors name what the user typed
FLAG_OF = {
    "model": "--model/--config",
    "training.micro_batch_size": "--micro-batch",
    "training.seq_len": "--seq-len",
    "training.precision": "--precision",
    "training.optimizer": "--optimizer",
    "training.quantization": "--quantization",
    "training.optimizer_in_backward": "--optimizer-in-backward",
    "training.sharding": "--zero/--sharding",
    "training.data_parallel_size": "--data-parallel",
    "training.tensor_parallel_size": "--tensor-parallel",
    "training.pipeline_parallel_size": "--pipeline-parallel",
    "training.attention": "--attention",
    "training.context_parallel_size": "--context-parallel",
    "training.sequence_parallel": "--sequence-parallel",
    "training.pipeline_schedule": "--pipeline-schedule",
    "training.num_micro_batches": "--micro-batches",
    "training.pipeline_chunks_per_rank": "--pipeline-chunks",
    "training.lora_rank": "--lora-rank",
    "training.lora_target_modules": "--lora-targets",
    "training.frozen_layers": "--frozen-layers",
    "training.checkpoint_impl": "--checkpoint-impl",
    "training.offload_optimizer": "--offload-optimizer",
    "training.offload_parameters": "--offload-parameters",
    "training.gradient_accumulation_steps": "--grad-accum",
    "cluster.gpus_per_node": "--gpus-per-node",
    "cluster.gpu": "--gpu",
    "cluster.gpu_memory_gib": "--gpu-memory-gib",
    "cluster.gpu_count": "--gpus",
    "cluster": "--gpu/--gpu-memory-gib",
    "headroom_fraction": "--headroom",
    "alloc_conf": "--alloc-conf",
    "layout": "--layout",
    "training.expert_parallel_size": "--expert-parallel",
    "training.moe_imbalance_factor": "--moe-imbalance",
}


class InputError(ValueError):
    """Bad command-line input (exit code 2); the message names the flag."""


# -- parser ----------------------------------------------------------------------------------------------
def _default(field: str) -> Any:
    """The request schema's default for a training field: defaults live once, in :class:`TrainingIn`."""
    value = TrainingIn.model_fields[field].default
    return getattr(value, "value", value)


def _gpu_name(text: str) -> str:
    key = text.strip().upper().replace("_", "-").replace(" ", "-")
    for name in GPUS:
        if name.upper() == key:
            return name
    close = close_names(text, GPUS)  # as an unknown --model is told (data.catalog.get)
    raise argparse.ArgumentTypeError(
        f"unknown GPU {text[:64]!r}{'...' if len(text) > 64 else ''}; "
        + (
            f"close matches: {', '.join(close)}; all GPUs: `memfit gpus`;"
            if close
            else f"choose from {', '.join(GPUS)}"
        )
        + " or give --gpu-memory-gib"
    )


def _integer(text: str) -> int:
    """An integer flag's value. Its range is the request schema's (:class:`memfit.api.RecommendRequest`), checked
    with the request, so ``--micro-batch -2`` is told the flag, the field and the allowed range as any value out of
    range is (:func:`describe_validation_error`), not argparse's bare ``-2 must be >= 1``."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _seconds(text: str, zero_ok: bool = False) -> float:
    """``--timeout-s`` (> 0) and ``--final-wait-s`` (>= 0: ``zero_ok``): a finite number of seconds (not a request
    field: checked here)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 <= value if zero_ok else 0 < value) or not value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds {'>=' if zero_ok else '>'} 0 (got {text})"
        )
    return value


def _folder(text: str) -> Path:
    """``--registry``: an existing folder (a missing one read as "no model registered")."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a folder" + ("" if path.exists() else " (it does not exist)")
        )
    return path


def _url(text: str) -> str:
    """``--url``: an http(s) URL with a host (:func:`memfit.client.check_url`)."""
    from memfit.client import check_url

    try:
        return check_url(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class _Parser(argparse.ArgumentParser):
    """argparse with a short error: the error and where the flags are listed (``memfit recommend --help``),
    not argparse's usage block of every flag first (23 lines for ``recommend``, above a one-line error).
    Exit code 2, as argparse's (bad input)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\nsee `{self.prog} --help`\n")

    def parse_args(self, args=None, namespace=None):  # an unknown flag is the subcommand's error, not memfit's
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self.command_parser(getattr(ns, "command", None)).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def command_parser(self, command: str | None) -> argparse.ArgumentParser:
        """The subcommand's parser (its errors point at ``memfit <command> --help``); this one for no command."""
        subcommands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        return subcommands.get(command, self)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, every line within the terminal's width (argparse's own: ``COLUMNS``, else
    :func:`shutil.get_terminal_size`). argparse wraps at spaces only, so two things overran 80 columns (84 to 121):
    a flag's choices, shown as one ``{a,b,...}`` word in the usage and the flag's line, and the exit codes, kept
    line by line as written. Choices wider than :attr:`INLINE` columns are shown as ``NAME`` and listed in the
    help, where they wrap; the description and epilog are filled to the width, each line that starts with a label
    (``2  bad input: ...``) with its wrapped lines indented under the text after the label."""

    INLINE = 40

    def _listed(self, action: argparse.Action) -> bool:
        choices = action.choices
        return action.metavar is None and choices is not None and len(",".join(map(str, choices))) + 2 > self.INLINE

    def _metavar_formatter(self, action: argparse.Action, default_metavar: str):
        if self._listed(action):
            return lambda size: ("NAME",) * size
        return super()._metavar_formatter(action, default_metavar)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not self._listed(action):
            return action.help
        head, default, tail = text.partition(" (default")
        return f"{head}; one of: {', '.join(map(str, action.choices or ()))}{default}{tail}"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import re
        import textwrap

        items: list[list[Any]] = []  # [indent, hanging indent, text] per labelled line, its continuations joined
        for line in text.splitlines():
            lead = len(line) - len(line.lstrip())
            if items and line.strip() and items[-1][2] and lead == items[-1][1] > items[-1][0]:
                items[-1][2] += " " + line.strip()
                continue
            label = re.match(r"\s*\S+ {2,}", line)
            items.append([lead, label.end() if label else lead, line.strip()])
        return "\n".join(
            textwrap.fill(
                body,
                width,
                initial_indent=indent + " " * lead,
                subsequent_indent=indent + " " * hang,
                break_long_words=False,
                break_on_hyphens=False,
            )
            if body
            else ""
            for lead, hang, body in items
        )


def _memfit_version() -> str:
    """The installed memfit distribution's version (``pyproject.toml``), or ``unknown`` when run from a tree that
    was never installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("memfit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``memfit`` argument parser (subcommands ``recommend``, ``models``, ``gpus``)."""
    fmt = _Formatter
    p = _Parser(
        prog="memfit",
        description="Fit LLM training into GPU memory: which decoder layers to activation-checkpoint.",
        epilog=__doc__.split("Exit codes:")[1].join(["exit codes (memfit recommend):", ""]),
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"memfit {_memfit_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{recommend,models,gpus}")
    r = sub.add_parser(
        "recommend",
        help="how many (and which) layers to checkpoint",
        formatter_class=fmt,
        description="The smallest number of checkpointed layers k whose predicted peak fits the GPU.",
        epilog="exit codes:" + __doc__.split("Exit codes:")[1],
    )

    m = r.add_argument_group("model (one of)")
    which = m.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model",
        metavar="NAME",
        help="catalog name or alias (see `memfit models`), or a HF id (org/name) whose config.json "
        "is in the local HF cache; never downloaded",
    )
    which.add_argument(
        "--config", metavar="PATH", type=Path, help="a HF config.json, or a model folder holding one (any architecture)"
    )

    t = r.add_argument_group("training (per GPU)")
    t.add_argument("--micro-batch", type=_integer, required=True, metavar="N", help="sequences per GPU per step")
    t.add_argument("--seq-len", type=_integer, required=True, metavar="TOKENS", help="tokens per sequence")
    t.add_argument(
        "--precision",
        choices=[x.value for x in Precision],
        help="training numerics (default: bf16 for LoRA, a bf16 frozen base as PEFT/TRL/torchtune load "
        "it; amp_bf16 otherwise, QLoRA included)",
    )
    t.add_argument(
        "--optimizer",
        choices=[*(x.value for x in Optimizer), *OPTIMIZER_ALIASES],
        help=f"optimizer; adamw is PyTorch's default torch.optim.AdamW, which runs adamw_foreach on CUDA "
        f"(default: {_default('optimizer')})",
    )
    shard = t.add_mutually_exclusive_group()
    shard.add_argument("--zero", type=int, choices=sorted(ZERO), help="DeepSpeed ZeRO stage (default: 0, no sharding)")
    shard.add_argument(
        "--sharding",
        choices=[x.value for x in Sharding],
        help="sharding by name, e.g. fsdp_full_shard (instead of --zero)",
    )
    t.add_argument(
        "--data-parallel",
        type=_integer,
        metavar="N",
        help="data-parallel size (default: GPUs / (tensor x pipeline parallel))",
    )
    t.add_argument(
        "--tensor-parallel",
        type=_integer,
        metavar="N",
        help=f"tensor-parallel size (default: {_default('tensor_parallel_size')})",
    )
    t.add_argument(
        "--pipeline-parallel",
        type=_integer,
        metavar="N",
        help=f"pipeline stages (default: {_default('pipeline_parallel_size')})",
    )
    t.add_argument(
        "--context-parallel",
        type=_integer,
        metavar="N",
        help=f"context-parallel size, divides --seq-len (default: {_default('context_parallel_size')})",
    )
    t.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="Megatron sequence parallelism over the tensor-parallel ranks",
    )
    t.add_argument(
        "--pipeline-schedule",
        choices=[x.value for x in PipelineSchedule],
        help=f"pipeline schedule (default: {_default('pipeline_schedule')})",
    )
    t.add_argument(
        "--micro-batches",
        type=_integer,
        metavar="M",
        help="micro-batches per step through the pipeline (default: the stage count)",
    )
    t.add_argument(
        "--pipeline-chunks",
        type=_integer,
        metavar="V",
        help=f"model chunks per rank, interleaved_1f1b (default: {_default('pipeline_chunks_per_rank')})",
    )
    t.add_argument(
        "--attention", choices=[x.value for x in Attention], help=f"attention kernel (default: {_default('attention')})"
    )
    t.add_argument("--lora-rank", type=_integer, metavar="R", help="LoRA fine-tune with this rank (default: full)")
    t.add_argument(
        "--frozen-layers",
        type=_integer,
        metavar="N",
        help="frozen fine-tune: the input embeddings and the first N decoder layers frozen (default: full)",
    )
    t.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="with --lora-rank: comma-separated module names LoRA adapts, PEFT's target_modules, e.g. "
        "q_proj,k_proj,v_proj,o_proj (default: PEFT's default for the model type)",
    )
    t.add_argument(
        "--checkpoint-impl",
        choices=[x.value for x in CheckpointImpl],
        help=f"torch.utils.checkpoint flavour (default: {_default('checkpoint_impl')})",
    )
    t.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        default=None,
        help="optimizer step fused into backward per parameter (torchtune optimizer_in_bwd)",
    )
    t.add_argument(
        "--quantization",
        choices=[x.value for x in Quantization],
        help="QLoRA base weights, with --lora-rank (default: the config's quantization_config, else none)",
    )
    t.add_argument(
        "--grad-accum",
        type=_integer,
        metavar="N",
        help="gradient accumulation steps: micro-batches per optimizer step (default: 1)",
    )
    t.add_argument(
        "--offload-optimizer",
        choices=[x.value for x in Offload],
        help="cpu: optimizer states + fp32 master weights in host memory (ZeRO-Offload; default: none)",
    )
    t.add_argument(
        "--offload-parameters",
        choices=[x.value for x in Offload],
        help="cpu: parameters in host memory too (ZeRO-3 offload_param, FSDP2 CPUOffloadPolicy; default: none)",
    )
    t.add_argument(
        "--expert-parallel",
        type=_integer,
        metavar="N",
        help=f"MoE: ranks the experts are split over (default: {_default('expert_parallel_size')})",
    )
    t.add_argument(
        "--moe-imbalance",
        type=float,
        metavar="F",
        help=f"MoE: the hottest expert's share relative to balanced, >= 1 "
        f"(default: {_default('moe_imbalance_factor')})",
    )

    c = r.add_argument_group("cluster (one of --gpu / --gpu-memory-gib)")
    mem = c.add_mutually_exclusive_group(required=True)
    mem.add_argument("--gpu", type=_gpu_name, metavar="NAME", help=f"GPU model, one of: {', '.join(GPUS)}")
    mem.add_argument("--gpu-memory-gib", type=float, metavar="GIB", help="device memory in GiB (instead of --gpu)")
    c.add_argument("--gpus", type=_integer, default=1, metavar="N", help="GPUs in the job (default: 1)")
    c.add_argument(
        "--gpus-per-node",
        type=_integer,
        metavar="N",
        help="GPUs sharing one host, for the host memory of offload (default: min(GPUs, 8))",
    )
    c.add_argument(
        "--headroom",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="share of device memory kept free, 0..0.9 (default: 0.05)",
    )
    c.add_argument(
        "--alloc-conf",
        metavar="CONF",
        help="the job's PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True (default: this shell's "
        "PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF, else PyTorch's defaults); the fit is decided by replaying "
        "the step through a model of PyTorch's caching allocator with it",
    )
    c.add_argument(
        "--layout",
        choices=["block", "even"],
        default="block",
        help="which layers: the first k of each pipeline stage (Megatron's block) or spread evenly (default: block)",
    )

    o = r.add_argument_group("answer")
    o.add_argument("--url", type=_url, help="ask the memfit service at this URL instead of the local model registry")
    o.add_argument(
        "--registry", type=_folder, metavar="DIR", help="local model registry folder (default: the shipped data/models)"
    )
    o.add_argument(
        "--timeout-s",
        type=_seconds,
        metavar="SECONDS",
        help=f"with --url: timeout of each request to the service, in seconds (default: {TIMEOUT_S:g})",
    )
    o.add_argument(
        "--final-wait-s",
        type=functools.partial(_seconds, zero_ok=True),
        metavar="SECONDS",
        help="with --url: how long to ask again while the service is still working out the answer (its `pending`: "
        f"a trace for the GPU, allocation streams); 0 prints the first answer as it is (default: {FINAL_WAIT_S:g})",
    )
    out = o.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the answer as JSON (bytes)")
    out.add_argument(
        "--explain", action="store_true", help="also print the memory breakdown and the curve over k as a chart"
    )
    o.add_argument(
        "--verbose",
        action="store_true",
        help="show the libraries' own output and warnings on stderr (default: dropped)",
    )

    sub.add_parser("models", help="list the catalog's model names, each with its aliases")
    sub.add_parser("gpus", help="list the known GPUs and their memory")
    return p


# -- gather ----------------------------------------------------------------------------------------------
def read_config(path: Path) -> dict[str, Any]:
    """A HF ``config.json`` dict from a file or a model folder.

    Raises:
        InputError: missing file, not JSON, or no ``model_type``.
    """
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InputError(
            f"--config: {file} does not exist" + (" (the folder has no config.json)" if path.is_dir() else "")
        )
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"--config: {file} is not a JSON file: {err}") from None
    if not isinstance(cfg, dict) or not cfg.get("model_type"):
        raise InputError(f"--config: {file} has no 'model_type': not a HF transformers config.json")
    from memfit.describe import clean_hf_config

    cleaned = clean_hf_config(cfg)
    if cfg.get("quantization_config") is not None:  # sets --quantization's default (a QLoRA base)
        cleaned["quantization_config"] = cfg["quantization_config"]
    return cleaned


def cached_hf_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local HF cache (``HF_HUB_CACHE``/``HF_HOME``), or None. Offline."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found) if isinstance(found, str) else None


def model_from_args(a: argparse.Namespace) -> str | dict[str, Any]:
    """The request's ``model`` field as the flags give it: a catalog name (its canonical name, looked up by
    :func:`model.job.resolve_architecture`), or a HF config dict (``--config``, a path, or the HF cache), read, not
    resolved: :func:`model.job.resolve` resolves the request.

    Raises:
        InputError: unknown everywhere; the message says where it looked and what to do.
    """
    if a.config is not None:
        return read_config(a.config)
    from memfit.api import check_model_name

    try:
        check_model_name(a.model)  # before any lookup: a 100,000-character name cost seconds and was echoed whole
    except ValueError as err:
        raise InputError(f"--model: {err}") from None
    from model.job import resolve_architecture

    try:
        return resolve_architecture(a.model).name
    except KeyError as err:
        close = str(err).strip("'\"")
    if Path(a.model).expanduser().exists():
        return read_config(Path(a.model).expanduser())
    if "/" in a.model:
        found = cached_hf_config(a.model)
        if found is not None:
            return read_config(found)
        cache = os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ.get("HF_HOME", "~/.cache/huggingface"), "hub")
        raise InputError(
            f"--model: {a.model!r} is not in the catalog and its config.json is not in the local HF "
            f"cache ({cache}); memfit never downloads. Fetch it with `hf download {a.model} config.json` "
            "or pass --config PATH"
        )
    raise InputError(f"--model: {close}; or pass --config PATH for a model outside the catalog")


def request_from_args(a: argparse.Namespace) -> RecommendRequest:
    """The :class:`RecommendRequest` the flags describe; unset flags take the schema's defaults.

    Raises:
        InputError: an unknown model or unreadable config. ValidationError: a value out of range.
    """
    training: dict[str, Any] = {"micro_batch_size": a.micro_batch, "seq_len": a.seq_len}
    for flag, field in (
        ("precision", "precision"),
        ("optimizer", "optimizer"),
        ("attention", "attention"),
        ("data_parallel", "data_parallel_size"),
        ("tensor_parallel", "tensor_parallel_size"),
        ("pipeline_parallel", "pipeline_parallel_size"),
        ("checkpoint_impl", "checkpoint_impl"),
        ("optimizer_in_backward", "optimizer_in_backward"),
        ("quantization", "quantization"),
        ("context_parallel", "context_parallel_size"),
        ("sequence_parallel", "sequence_parallel"),
        ("pipeline_schedule", "pipeline_schedule"),
        ("micro_batches", "num_micro_batches"),
        ("pipeline_chunks", "pipeline_chunks_per_rank"),
        ("offload_optimizer", "offload_optimizer"),
        ("offload_parameters", "offload_parameters"),
        ("expert_parallel", "expert_parallel_size"),
        ("moe_imbalance", "moe_imbalance_factor"),
        ("grad_accum", "gradient_accumulation_steps"),
    ):
        if getattr(a, flag) is not None:
            training[field] = getattr(a, flag)
    if a.sharding is not None or a.zero is not None:
        training["sharding"] = a.sharding or ZERO[a.zero].value
    if a.lora_rank is not None and a.frozen_layers is not None:
        raise InputError("--frozen-layers: not with --lora-rank (a fine-tune is full, LoRA or frozen)")
    if a.lora_rank is not None:
        training.update(finetune="lora", lora_rank=a.lora_rank)
    if a.frozen_layers is not None:
        training.update(finetune="frozen", frozen_layers=a.frozen_layers)
    if a.lora_targets is not None:
        if a.lora_rank is None:
            raise InputError("--lora-targets: needs --lora-rank (LoRA fine-tune)")
        training["lora_target_modules"] = [name.strip() for name in a.lora_targets.split(",") if name.strip()]
    cluster: dict[str, Any] = {"gpu_count": a.gpus}
    if a.gpus_per_node is not None:
        cluster["gpus_per_node"] = a.gpus_per_node
    if a.gpu_memory_gib is not None:
        cluster["gpu_memory_gib"] = a.gpu_memory_gib
    else:
        cluster["gpu"] = a.gpu
    return RecommendRequest.model_validate(
        {
            "model": model_from_args(a),
            "training": training,
            "cluster": cluster,
            "headroom_fraction": a.headroom,
            "layout": a.layout,
            "alloc_conf": (alloc_conf_from_env() if getattr(a, "alloc_conf", None) is None else a.alloc_conf) or None,
        }
    )


def flag_problem(field: str, message: str, allowed: str | None = None) -> str:
    """One problem with a request field as the command line says it: ``--flag (field): message (allowed: ...)``,
    named by the flag that sets the field (:data:`FLAG_OF`) and with the allowed range worded as the service's
    422 words it (:func:`service.errors.field_problem`); the field (or its section, e.g. ``training: ``) is not
    repeated at the start of the message. A field no flag sets is named alone (``field: message``)."""
    from service.errors import field_problem

    section = field.split(".")[0]
    message = field_problem(field, message, allowed)
    flag = FLAG_OF.get(field) or FLAG_OF.get(section)
    return f"{flag} ({field}): {message}" if flag else f"{field or 'request'}: {message}"


#: pydantic's error types that state one bound of a range ("less than or equal to 0.9"): said as the whole range
BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem (:func:`flag_problem`), with the value given: ``--headroom (headroom_fraction): must be
    a finite number in [0, 0.9] (got 2.0)``; the allowed range is the service's (:func:`service.errors.allowed_range`
    of the request schema), and a value beyond one bound is told the whole range, not pydantic's one bound."""
    from memfit.errors import pydantic_error_field
    from service.errors import allowed_range

    lines = []
    for e in err.errors():
        path = tuple(x for x in e["loc"] if not str(x).startswith(("function-", "dict[", "str")))
        # a check inside a validator (InvalidConfiguration) names its own field below the location
        loc, msg, own = pydantic_error_field(e, path)
        # such a check words its allowed values in its message (shown as it is, as in the service's 422 detail)
        allowed = None if own else allowed_range(RecommendRequest, path)
        if allowed and e.get("type") in BOUND_ERRORS:
            msg = f"must be {allowed}"
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {repr(got)[:80]})"
        lines.append(flag_problem(loc, msg, allowed) + shown)
    return "\n".join(dict.fromkeys(lines))


# -- answer ----------------------------------------------------------------------------------------------
class NoAnswer(RuntimeError):
    """No recommendation could be had (exit code 1)."""


def recommend_local(req: RecommendRequest, registry: Path | None) -> Recommendation:
    """The answer of the registry's current model (:class:`service.recommender.Recommender`), from the on-disk answer
    cache when the same request met the same code, data, registry, store and libraries before
    (:class:`service.answer_cache.AnswerCache`: ``benchmarks/results/cli_latency.txt``). The request's
    parallel layout is checked against the model's shape first (:func:`service.recommender.check_request`), before
    the registry, the store and the predictor load: a bad ``--tensor-parallel`` was told after 10 s, now after 2.

    Raises:
        InvalidConfiguration: the request cannot run (field named). NoAnswer: no model is registered.
    """
    from service.answer_cache import AnswerCache
    from service.settings import Settings

    cache = AnswerCache.from_env()
    root = registry if registry is not None else Path(__file__).resolve().parent.parent / "data" / "models"
    db_url = str(Settings().db_url)
    key = cache.key(req.model_dump_json(), root, db_url) if cache is not None else None
    hit = cache.get(key) if cache is not None and key is not None else None
    if hit is not None:
        try:
            return Recommendation.model_validate_json(hit)
        except ValidationError:  # written by another memfit: answer afresh
            pass
    rec = _recommend_uncached(req, registry)
    if cache is not None and not any("tracing it failed" in w for w in rec.warnings):
        # keyed after answering: a configuration traced now added its terms to the store the next run reads
        after = cache.key(req.model_dump_json(), root, db_url)
        if after is not None:
            cache.put(after, rec.model_dump_json())
    return rec


def _recommend_uncached(req: RecommendRequest, registry: Path | None) -> Recommendation:
    from service.recommender import check_request

    check_request(req)
    from model.registry import Registry

    models = Registry(registry) if registry is not None else Registry()
    models.start_check()  # the model's canary child runs while the store, the terms and the predictor code load
    from model.terms import TermsCache
    from service.app import open_store
    from service.models import ModelHolder, overhead_from
    from service.settings import Settings
    from service.tracing import InlineTracer

    # the service's store, terms cache and GPU overhead (shared with a running service on the same data directory);
    # a configuration traced by neither is traced here once, so the command line gives the service's answer
    store, _reason = open_store(Settings())  # None where read-only: traced terms kept in memory
    terms = TermsCache(store.url if store is not None else None)
    tracer = InlineTracer(terms, announce=lambda msg: _say(f"memfit: {msg}"))
    from tracer.stream_source import configured_source  # the full model's allocation streams, recorded once

    streams = configured_source("record", announce=lambda msg: _say(f"memfit: {msg}"))
    holder = ModelHolder(models, overhead_from(store), terms=terms, tracer=tracer, streams=streams)
    holder.refresh()
    if holder.recommender is None:
        raise NoAnswer(f"no model registered ({holder.last_error or 'train one: python -m training.retrain'})")
    return holder.recommender.recommend(req)


#: the real stderr while :func:`library_output` redirects the libraries' output; None otherwise
_notes: Any = None


def _say(text: str) -> None:
    """Print one of memfit's own notes (not the libraries') to the user's stderr."""
    print(text, file=_notes or sys.stderr, flush=True)


@contextlib.contextmanager
def library_output(verbose: bool = False):
    """While memfit works out an answer, the libraries' own output stays off stdout, which carries only the answer.

    Redirected at the file descriptors, because DeepSpeed's logger writes its "Setting accelerator to CPU" warning to
    the ``sys.stdout`` it held at import (``deepspeed/utils/logging.py``), bitsandbytes logs that its optional
    ``kernels`` package is missing, and transformers warns through ``warnings`` and its own logger. At the default
    log level all of it is dropped; with ``verbose`` it goes to stderr. memfit's own notes (:func:`_say`) reach the
    real stderr either way."""
    global _notes
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    sink = None if verbose else tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    real_err = _notes = os.fdopen(os.dup(saved_err), "w", buffering=1)
    try:
        os.dup2(saved_err if sink is None else sink.fileno(), 1)
        if sink is not None:
            os.dup2(sink.fileno(), 2)
        yield
    finally:
        _notes = None
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err):
            os.close(fd)
        real_err.close()
        if sink is not None:
            sink.close()


def recommend_remote(
    req: RecommendRequest, url: str, timeout_s: float, final_wait_s: float = FINAL_WAIT_S
) -> Recommendation:
    """The service's final answer (strict :class:`memfit.Client`: no fallback plan on the command line), asked for
    again for up to ``final_wait_s`` while the service still works on it; stderr says so once.

    Raises:
        NoAnswer: unreachable, timed out or 5xx after retries, or not final within ``final_wait_s``.
        InputError: the service rejected it (4xx).
    """
    from memfit.client import Client, NotFinal, RequestRejected, ServiceError, not_final_reason, working_on

    told = []

    def waiting(interim: Recommendation, left_s: float) -> None:
        if not told:
            told.append(True)
            _say(f"memfit: the service is still {working_on(interim)}; asking again for up to {left_s:.0f} s")

    with Client(url, timeout_s=timeout_s, strict=True, final_wait_s=final_wait_s) as client:
        try:
            rec = client.recommend(req, waiting=waiting)
        except NotFinal as err:
            raise NoAnswer(not_final_reason(err.interim, err.final_wait_s, "--final-wait-s")) from None
        except ServiceError as err:
            raise NoAnswer(str(err)) from None
        except RequestRejected as err:
            raise InputError(describe_rejection(err)) from None
    if rec.pending:  # --final-wait-s 0
        _say(f"memfit: this answer is not final: the service is still {working_on(rec)}; ask again for the final one")
    return rec


def describe_rejection(err) -> str:
    """The service's 422 field errors (:class:`memfit.client.RequestRejected`) one per line, as local ones are
    (:func:`flag_problem`): ``--seq-len (training.seq_len): must be ... (allowed: an integer in [1, 1048576])``;
    the service's message alone when it names no field."""
    lines = [flag_problem(str(e.get("field") or ""), str(e.get("message") or ""), e.get("allowed")) for e in err.errors]
    return "\n".join(dict.fromkeys(lines)) or str(err)


# -- present ---------------------------------------------------------------------------------------------
def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def curve_rows(rec: Recommendation, max_rows: int = 12) -> list:
    """Curve points to show: about ``max_rows`` evenly spaced, always k = 0, L, the chosen k and the one below it
    (the boundary), and every k whose step the allocator simulation replayed (the figures the decision rests on)."""
    if not rec.curve:
        return []
    step = max(1, -(-len(rec.curve) // max_rows))
    keep = set(range(0, len(rec.curve), step)) | {len(rec.curve) - 1}
    if rec.k is not None:
        keep |= {rec.k, max(rec.k - 1, 0)}
    if rec.fit_method == "simulated":
        keep |= {i for i, c in enumerate(rec.curve) if c.predicted_reserved_bytes is not None}
    return [rec.curve[i] for i in sorted(keep)]


@functools.cache
def _pipe_console_class() -> type:  # rich is imported on first use: `memfit --help` stays fast
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:  # rich's default exits with status 1, hiding "nothing fits" (3)
            raise BrokenPipeError

    return PipeConsole


def _console():  # a rich Console that leaves the exit code to main when the reader of stdout left
    return _pipe_console_class()()


def render(rec: Recommendation, *, explain: bool = False, label: str | None = None, console: Any = None) -> None:
    """Print the answer: verdict, the curve table with the chosen k marked, alternatives and warnings;
    with ``explain`` also the breakdown at k and the curve as a bar chart."""
    from rich.text import Text

    con = console or _console()
    title = f"memfit: {rec.model_name or label or 'model'} — {rec.num_layers} layers (predictor {rec.model_version})"
    head = titled(title, show_header=False)
    head.add_column("")
    head.add_column("", justify="right")
    if rec.fits:
        head.add_row("answer", f"[bold green]checkpoint {rec.k} of {rec.num_layers} layers[/]")
        head.add_row("layers", layer_ranges(rec.layers) or "none")
        head.add_row("recompute overhead", f"{rec.recompute_overhead_fraction:.1%} of step compute")
    else:
        head.add_row("answer", "[bold red]does not fit at any k[/] (even checkpointing every layer)")
    head.add_row("predicted peak (allocated)", f"{gib(rec.predicted_peak_bytes)} GiB")
    head.add_row("upper bound + overhead", f"{gib(rec.total_upper_bytes)} GiB")
    head.add_row("usable / capacity", f"{gib(rec.usable_bytes)} / {gib(rec.capacity_bytes)} GiB")
    if not rec.fits:
        # of usable memory: the card needed adds it over (1 - headroom) (helper 42 added it to the card, 3 GiB short)
        card = rec.capacity_bytes + rec.shortfall_bytes * rec.capacity_bytes / max(rec.usable_bytes, 1)
        head.add_row(
            "shortfall", f"{gib(rec.shortfall_bytes)} GiB of usable memory (a card of {gib(int(card) + 1)} GiB or more)"
        )
    if rec.parameters_per_rank is not None:
        t = rec.training or {}
        dp = int(t.get("data_parallel_size") or 1)
        n = rec.parameters_per_rank
        if t.get("offload_parameters") == "cpu":  # the shards live in host memory: only units in flight are here
            head.add_row(
                "parameters per GPU",
                f"none stored between uses (offloaded to the host), {n / 1e9:.3f} B in all, gathered a unit at a time",
            )
        elif t.get("sharding") in ("zero3", "fsdp_full_shard", "fsdp_shard_grad_op") and dp > 1:
            # two new users read the gathered count as the whole model on every GPU: both figures, each named
            head.add_row(
                "parameters per GPU",
                f"{n / dp / 1e9:.3f} B stored between uses ({t['sharding']}: 1/{dp} "
                f"each), {n / 1e9:.3f} B gathered while in use",
            )
        else:
            head.add_row("parameters per GPU", f"{n / 1e9:.3f} B")
    if rec.host_memory_bytes:
        head.add_row("host memory per node (offload)", f"{gib(rec.host_memory_bytes)} GiB")
    con.print(head)

    if rec.stages:
        stages = titled(f"pipeline stages (bottleneck: stage {rec.bottleneck_stage})")
        for col in ("stage", "layers", "k", "micro-batches in flight", "predicted GiB"):
            stages.add_column(col, justify="right")
        for st in rec.stages:
            stages.add_row(
                str(st.stage),
                f"{st.first_layer}-{st.first_layer + st.num_layers - 1}",
                str(st.k),
                f"{st.micro_batches_in_flight:g}",
                gib(st.predicted_peak_bytes),
                style="bold" if st.stage == rec.bottleneck_stage else None,
            )
        con.print(stages)

    # a simulated fit is decided on reserved memory: its figures at the k the search replayed ("-" elsewhere); the
    # reserved figure is the step's with memory to spare, "fits" the replay within the allocator's cap
    simulated = rec.fit_method == "simulated"
    curve = titled("memory over k (GiB; k = checkpointed layers)")
    if simulated:
        cap, room = rec.allocator_cap_bytes or 0, rec.allocator_room_bytes or 0
        within = (
            f"{gib(cap - room)} GiB ({gib(cap)} for the allocator less its largest request, {gib(room)}, kept free)"
            if room
            else f"{gib(cap)} GiB"
        )
        curve.caption = (
            f"fits: the step replayed through the caching allocator runs in {within}; reserved, uncapped: its peak "
            "with memory to spare (under a cap the allocator frees its cache and retries first)"
        )
    # the last column only marks the chosen k: none is chosen when nothing fits, and the column stood empty
    marked = rec.k is not None
    for col in (
        "k",
        "predicted",
        "bound+overhead",
        *(("reserved, uncapped",) if simulated else ()),
        "fits",
        *(("",) if marked else ()),
    ):
        curve.add_column(col, justify="right" if col else "left")
    for c in curve_rows(rec):
        chosen = c.k == rec.k
        reserved = "-" if c.predicted_reserved_bytes is None else gib(c.predicted_reserved_bytes)
        curve.add_row(
            str(c.k),
            gib(c.predicted_bytes),
            gib(c.total_upper_bytes),
            *((reserved,) if simulated else ()),
            "yes" if c.fits else "no",  # the test that chose k, not the bound against usable memory
            *(("[bold]◀ chosen k[/]" if chosen else "",) if marked else ()),
            style="bold green" if chosen else None,
        )
    con.print(curve)

    if explain:
        parts = titled(f"breakdown at k={rec.k if rec.k is not None else rec.num_layers} (GiB, each rounded to 0.01)")
        parts.add_column("part")
        parts.add_column("GiB", justify="right")
        # before bwd.emb the breakdown counts no gradients (model.curve.breakdown); from there on it counts them all
        building = (rec.peak_phase or "").startswith("bwd") and not rec.breakdown.get("gradients_bytes")
        for name, v in rec.breakdown.items():
            label = name.removesuffix("_bytes").replace("_", " ")
            if building and name in ("gradients_bytes", "activations_bytes"):  # model.curve.breakdown's convention
                label += (
                    " (building up layer by layer: counted with activations)"
                    if name == "gradients_bytes"
                    else " (with the gradients built so far)"
                )
            parts.add_row(label, gib(v))
        # the chain from the parts to what is compared with usable memory, each step named (the parts' sum and the
        # headline's "upper bound + overhead" differed by the margin, which was printed nowhere):
        # total_upper = upper bound + overhead at the bound (model.recommend.plan), upper bound = point + margin
        margin = rec.upper_bound_bytes - rec.predicted_peak_bytes
        overhead = int(rec.overhead.get("total_bytes", 0))
        parts.add_section()
        parts.add_row("predicted peak: the point prediction, the parts' sum", gib(rec.predicted_peak_bytes))
        parts.add_row(
            f"+ margin to the upper bound ({margin / max(rec.predicted_peak_bytes, 1):.1%} of the point)", gib(margin)
        )
        # the overhead's parts by name, those it holds (an "allocator allowance" was named where it held none)
        named = {
            "cuda_context_bytes": "CUDA context (outside PyTorch)",
            "cublas_workspace_bytes": "cuBLAS workspaces",
            "nccl_bytes": "NCCL buffers",
            "parameter_block_bytes": "parameter blocks",
            "fragmentation_bytes": "fragmentation allowance",
        }
        held = [what for key, what in named.items() if rec.overhead.get(key)]
        parts.add_row(f"+ overhead: {', '.join(held) or 'none'}", gib(overhead))
        parts.add_section()
        simulated = rec.fit_method == "simulated"
        room = rec.allocator_room_bytes or 0
        test = "fits when"
        if simulated:
            test = "must also be"
        elif room:
            test = f"fits when it + the largest request, {gib(room)},"
        parts.add_row(
            f"= upper bound + overhead ({test} <= usable {gib(rec.usable_bytes)})",
            gib(rec.total_upper_bytes),
            style="bold",
        )
        if rec.predicted_reserved_bytes is not None:
            how = "simulated caching allocator" if simulated else "measured allowance"
            # the figure is the step's uncapped reserved peak; the simulated test replays it within the allocator's cap
            # less the room kept free (model.reserved.simulate_step): a capped step frees cached blocks and can run in
            # less than its uncapped peak (helper 40 read "39.43, fits when ... within 36.30" as a contradiction)
            cap, room = rec.allocator_cap_bytes or 0, rec.allocator_room_bytes or 0
            test = (
                f", uncapped; the fit replays the step within {gib(cap - room)}"
                + (f": {gib(cap)} less its largest request" if room else "")
                if simulated
                else ""
            )
            parts.add_row(
                f"predicted peak reserved ({how}, {rec.allocator_settings_assumed} allocator settings{test})",
                gib(rec.predicted_reserved_bytes),
            )
        if rec.host_memory_bytes:
            parts.add_row("host memory per node (not on the device)", gib(rec.host_memory_bytes))
        con.print(parts)
        con.print(curve_chart(rec))

    if rec.alternatives:
        # the figures in a table and each cost as a numbered line below it: one row per alternative stays
        # readable in 80 columns (a cost column wrapped every row over a dozen lines)
        host = any(a.host_memory_bytes for a in rec.alternatives)
        alt = titled("alternatives (bound + overhead at k)")
        for col in ("#", "change", "fits", "k", "GiB", *(("host GiB",) if host else ())):
            alt.add_column(col, justify="left" if col == "change" else "right", ratio=1 if col == "change" else None)
        # an alternative judged on the measured allowance beside a simulated decision can say "fits" where the
        # simulation would not (the allowance estimates the reserved peak; it does not replay the step)
        unreplayed = rec.fit_method == "simulated" and any(a.fit_method != "simulated" for a in rec.alternatives)
        for i, a in enumerate(rec.alternatives, 1):
            marks = [a.path] if a.path != "traced" else []
            if unreplayed and a.fit_method != "simulated":
                marks.append("allocator not simulated")
            change = a.description + (f" [dim]({', '.join(marks)})[/]" if marks else "")
            alt.add_row(
                str(i),
                change,
                "yes" if a.fits else "no",
                "-" if a.k is None else str(a.k),
                gib(a.total_upper_bytes),
                *((gib(a.host_memory_bytes) if a.host_memory_bytes else "-",) if host else ()),
            )
        con.print(alt)
        legend = []
        if any(a.path != "traced" for a in rec.alternatives):
            legend.append("provisional: the changed configuration is not traced yet; the learned model answers")
        if unreplayed:
            legend.append(
                "allocator not simulated: judged on the reserved peak estimated from the allocated bound (the "
                "measured reserved / allocated ratio, the largest request kept free), not on a replay of the step: a "
                "'yes' there is less certain than the answer's own"
            )
        for line in legend:
            hanging(con, Text("  "), Text(line, style="dim"))
        for i, a in enumerate(rec.alternatives, 1):
            hanging(con, Text(f"  {i}. "), Text(f"cost: {a.cost}"))
    for w in rec.warnings:
        hanging(con, Text("warning: ", style="yellow"), Text(w))


def titled(title: str, **kwargs: Any) -> Any:
    """A rich ``Table`` at least as wide as its title: a narrow table (the headline's two short columns in 80
    columns) wrapped its title over two lines; only a title wider than the terminal wraps now."""
    from rich.table import Table

    return Table(title=title, min_width=len(title), **kwargs)


def hanging(con: Any, lead: Any, text: Any) -> None:
    """Print ``lead`` then ``text`` (rich ``Text``), the wrapped lines of ``text`` indented under its first
    character (a hanging indent), so a wrapped warning or cost stays under its bullet or number; no line is
    padded with spaces to the terminal's width."""
    from rich.text import Text

    indent = lead.cell_len
    out = Text()
    for i, line in enumerate(text.wrap(con, max(20, con.width - indent))):
        line.rstrip()
        out.append_text(lead if i == 0 else Text(" " * indent))
        out.append_text(line)
        out.append("\n")
    con.print(out, end="", soft_wrap=True, highlight=False)


def curve_chart(rec: Recommendation, width: int = 40) -> Any:
    """The curve as horizontal bars (bound + overhead per k), ``│`` at usable memory, ``┆`` at the limit the bar
    is tested against when the allowance keeps the largest request free (usable − :attr:`allocator_room_bytes`),
    the chosen k marked.

    Bars start at 80 % of the smallest value shown, so the differences between k stay visible.
    """
    from rich.text import Text

    rows = curve_rows(rec, max_rows=16)
    room = 0 if rec.fit_method == "simulated" else (rec.allocator_room_bytes or 0)
    limit = rec.usable_bytes - room
    values = [rec.usable_bytes, limit, *(c.total_upper_bytes for c in rows)]
    lo, hi = 0.8 * min(values), max(values)
    span = (hi - lo) or 1.0

    def col(v: float) -> int:
        return min(width - 1, max(0, round((v - lo) / span * (width - 1))))

    usable_col = col(rec.usable_bytes)
    heading = f"bound + overhead over k: bars from {lo / GIB:.1f} GiB, │ = usable {gib(rec.usable_bytes)} GiB"
    if room:
        heading += f", ┆ = usable - the largest request ({gib(room)}) = {gib(limit)} GiB: a fitting bar ends left of it"
    text = Text(heading + "\n", style="bold")
    for c in rows:
        n = col(c.total_upper_bytes) + 1
        bar = ["█" if i < n else " " for i in range(width)]
        if room:
            bar[col(limit)] = "┆"
        bar[usable_col] = "│"
        text.append(f"k={c.k:>4} ")
        text.append("".join(bar), style="green" if c.fits else "red")
        text.append(f" {gib(c.total_upper_bytes):>8} GiB")
        if c.k == rec.k:
            text.append("  ◀ chosen k", style="bold green")
        text.append("\n")
    return text


def layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


# -- main ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (see the module docstring)."""
    parser = build_parser()
    a = parser.parse_args(argv)  # argparse itself exits 2 on bad flags
    if a.command == "recommend" and not a.url:
        given = [f for f, v in (("--timeout-s", a.timeout_s), ("--final-wait-s", a.final_wait_s)) if v is not None]
        if given:  # the local answer asks no service: nothing would time out or wait
            verb = "apply" if len(given) > 1 else "applies"
            parser.command_parser(a.command).error(f"{' and '.join(given)} {verb} with --url only (asking the service)")
    # bitsandbytes, imported through PEFT, warns on CPU that its optional CPU 4-bit matmul kernel package is
    # missing; memfit never runs that kernel, and the notice read as an error under the answer
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if a.command in ("models", "gpus"):
        try:
            print_list(a.command)
            sys.stdout.flush()
        except BrokenPipeError:  # `memfit models | head`
            _reader_left()
        return EXIT_FITS
    try:
        with library_output(a.verbose):  # stdout carries only the answer
            req = request_from_args(a)
            rec = (
                recommend_remote(
                    req,
                    a.url,
                    TIMEOUT_S if a.timeout_s is None else a.timeout_s,
                    FINAL_WAIT_S if a.final_wait_s is None else a.final_wait_s,
                )
                if a.url
                else recommend_local(req, a.registry)
            )
    except ValidationError as err:
        print(f"memfit: error: {describe_validation_error(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (InputError, MemfitError) as err:  # input the user can fix (InvalidConfiguration, UnknownModel); as the
        # service answers 422 for InvalidConfiguration only, any other exception is memfit's fault (below)
        text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        if FLAG_OF.get(getattr(err, "field", "")):  # a check of the recommender (InvalidConfiguration)
            text = flag_problem(err.field, text, getattr(err, "allowed", None))
        print(f"memfit: error: {text}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NoAnswer as err:
        print(f"memfit: no answer: {err}", file=sys.stderr)
        return EXIT_NO_ANSWER
    except Exception as err:  # noqa: BLE001 - a bug is told as one, never as bad input
        return internal_error(err)
    try:
        if a.json:
            print(json.dumps(rec.model_dump(mode="json"), indent=1))
        else:
            render(rec, explain=a.explain, label=str(a.config) if a.config is not None else a.model)
        sys.stdout.flush()
    except BrokenPipeError:  # `memfit recommend ... | head`: the reader left; the exit code still tells the answer
        _reader_left()
    except Exception as err:  # noqa: BLE001
        return internal_error(err)
    return EXIT_FITS if rec.fits else EXIT_NO_FIT


def internal_error(err: BaseException) -> int:
    """Tell a fault of memfit as one (exit code 4): ``memfit: internal error: <type>: <message>`` and where it was
    raised, never as bad input (exit code 2, which would blame a flag for memfit's own fault)."""
    import traceback

    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" (raised at {Path(where.filename).name}:{where.lineno})" if where else ""
    print(f"memfit: internal error: {type(err).__name__}: {err}{at}; please report it", file=sys.stderr)
    return EXIT_INTERNAL


def _reader_left() -> None:
    """Stdout's reader left (``| head``): the rest goes to devnull, as the Python docs' SIGPIPE note advises."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def print_list(command: str) -> None:
    """``memfit models``: each catalog name with the aliases ``--model`` also takes, wrapped under the aliases to
    the terminal's width; ``memfit gpus``: the known GPUs by usable memory (GiB), then name."""
    if command == "models":
        import textwrap

        from data import catalog

        width = max(40, shutil.get_terminal_size().columns)
        for name in catalog.names():
            aliases = ", ".join(catalog.get(name).get("aliases", []))
            print(
                textwrap.fill(
                    aliases, width, initial_indent=f"{name:<24} ", subsequent_indent=" " * 25, break_on_hyphens=False
                )
                if aliases
                else name
            )
    else:
        for name, size in sorted(GPUS.items(), key=lambda item: (item[1], item[0])):
            print(f"{name:<12} {size / GIB:7.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())

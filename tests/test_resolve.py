"""Resolve once (issue 29.1): one resolver (:func:`model.job.resolve`) turns a model, a training configuration and a
cluster into a :class:`model.job.Job`; every server-side caller goes through it, and the defaults it fills (the
data-parallel size, the LoRA rank) live once, in :mod:`memfit.schema`."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from data import catalog
from memfit.api import ArchitectureIn, ClusterIn, TrainingIn
from memfit.describe import clean_hf_config
from memfit.errors import InvalidConfiguration, UnknownArchitecture, UnknownModel
from memfit.hf import _hf_config
from memfit.schema import DEFAULT_LORA_RANK, ModelSpec, TrainingConfig
from model.job import Architecture, resolve, resolve_architecture
from model.snapshot import config_key
from model.terms import terms_key

ROOT = Path(__file__).resolve().parent.parent
LLAMA_3_8B_PARAMS = 8_030_261_248  # data/architectures/llama-3-8b.json published_params
SHAPE = {"model_name", "total_params", "trainable_params"}


def _full_form(cfg: dict) -> dict:
    """The config serialised in full, as ``memfit.describe()`` sends it."""
    return clean_hf_config(json.loads(json.dumps(_hf_config(cfg).to_dict(), default=str)))


def test_a_catalog_name_its_config_and_its_full_serialisation_resolve_alike():
    by_name = resolve_architecture("llama-3-8b")
    published = catalog.get("llama-3-8b")["hf_config"]
    by_config, by_full = resolve_architecture(published), resolve_architecture(_full_form(published))
    assert by_name.name == "llama-3-8b" and by_config.name is None
    assert by_name.spec.num_layers == 32 and by_name.spec.hidden_size == 4096
    assert by_name.spec.num_key_value_heads == 8 and by_name.spec.intermediate_size == 14336
    # the catalog's published count; a config is counted on a meta build, which gives the same for this model
    assert by_name.spec.total_params == by_config.spec.total_params == by_full.spec.total_params == LLAMA_3_8B_PARAMS
    assert by_name.key == by_config.key == by_full.key == config_key(published)
    assert by_name.spec.model_dump(exclude=SHAPE) == by_config.spec.model_dump(exclude=SHAPE)
    assert by_config.spec.model_dump(exclude=SHAPE) == by_full.spec.model_dump(exclude=SHAPE)
    assert by_name.layer_period == 1 and by_name.num_routed_experts is None
    # an alias is the same cached architecture; an Architecture resolves to itself
    assert resolve_architecture("meta-llama/Meta-Llama-3-8B") is by_name
    assert resolve_architecture(by_name) is by_name


def test_explicit_fields_and_a_telemetry_row_spec():
    fields = ArchitectureIn(
        num_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024, vocab_size=1000, total_params=123
    )
    arch = resolve_architecture(fields)
    assert (arch.spec.num_layers, arch.spec.total_params, arch.hf_config["num_hidden_layers"]) == (4, 123, 4)
    row = catalog.spec("gpt2").model_copy(update={"trainable_params": 5})
    measured = resolve_architecture(row)
    assert measured.spec is row and measured.hf_config == catalog.get("gpt2")["hf_config"]
    unknown = resolve_architecture(ModelSpec(**{**row.model_dump(), "model_name": "someone-elses-model"}))
    assert unknown.hf_config is None and unknown.key is None


@pytest.mark.parametrize(
    ("model", "error", "field"),
    [
        ("no-such-model", UnknownModel, "model"),
        ({**catalog.get("llama-3-8b")["hf_config"], "model_type": "bogus"}, UnknownArchitecture, "model.model_type"),
        (
            {**catalog.get("llama-3-8b")["hf_config"], "num_key_value_heads": 7},
            InvalidConfiguration,
            "model.num_key_value_heads",
        ),
        ({**catalog.get("llama-3-8b")["hf_config"], "hidden_act": "nope"}, InvalidConfiguration, "model.hidden_act"),
    ],
)
def test_a_bad_model_is_the_domain_error_naming_its_field(model, error, field):
    with pytest.raises(error) as err:
        resolve(model, TrainingIn(micro_batch_size=1, seq_len=512))
    assert err.value.field == field


def test_an_unknown_family_is_predicted_as_its_fallback_with_a_warning():
    cfg = {**catalog.get("llama-3-8b")["hf_config"], "model_type": "bogus"}
    with pytest.raises(UnknownArchitecture) as err:
        resolve_architecture(cfg, "also-bogus")
    assert err.value.field == "architecture_fallback"
    arch = resolve_architecture(cfg, "llama")
    assert arch.hf_config["model_type"] == "llama" and arch.spec.total_params == LLAMA_3_8B_PARAMS
    assert len(arch.warnings) == 1 and "'bogus'" in arch.warnings[0]


def test_a_request_job_fills_the_defaults_from_the_schema():
    cluster = ClusterIn(gpu="H100-80GB", gpu_count=8)
    job = resolve(
        "llama-3-8b", TrainingIn(micro_batch_size=1, seq_len=2048, finetune="lora", tensor_parallel_size=2), cluster
    )
    assert job.training.data_parallel_size == 4  # 8 GPUs / tensor parallel 2 (memfit.schema.default_data_parallel_size)
    assert job.training.lora_rank == DEFAULT_LORA_RANK == 8
    assert job.gpu_count == 8 and job.cluster is cluster and job.training.checkpoint_layers == []
    # LoRA adds its adapters to the total: rank 8 on q_proj (4096 -> 4096) and v_proj (4096 -> 1024), 32 layers
    adapters = 8 * ((4096 + 4096) + (4096 + 1024)) * 32
    assert job.spec.trainable_params == adapters == 3_407_872
    assert job.spec.total_params == LLAMA_3_8B_PARAMS + adapters
    assert job.architecture.spec.total_params == LLAMA_3_8B_PARAMS


def test_a_full_training_config_is_taken_as_given_and_its_facts_are_cached():
    training = TrainingConfig(micro_batch_size=2, seq_len=1024, checkpoint_layers=[0, 1])
    job = resolve("gpt2", training)
    assert job.training == training.model_copy(update={"checkpoint_layers": []})
    assert job.spec is job.architecture.spec and job.gpu_count == 1
    assert job.parameters_per_rank == job.spec.total_params == catalog.spec("gpt2").total_params
    assert job.stages is job.stages and job.rank_spec is job.spec
    assert job.terms_key() == terms_key(job.hf_config, job.training, None)
    assert job.terms_key("sm90") == terms_key(job.hf_config, job.training, "sm90")
    assert job.states.total_bytes > 0 and job.step_temporary_bytes_per_param >= 0


# -- one resolver, one default ---------------------------------------------------------------------------------
PACKAGES = ("memfit", "data", "model", "tracer", "service", "training", "scripts", "benchmarks")
#: the former resolvers; only model/job.py may define one
RESOLVER_NAMES = {"resolve_model", "_resolve_config", "_catalog_model", "model_shape", "training_config", "resolve"}


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _called(node: ast.Call) -> str:
    f = node.func
    if isinstance(f, ast.Attribute):
        return f"{f.value.id}.{f.attr}" if isinstance(f.value, ast.Name) else f.attr
    return f.id if isinstance(f, ast.Name) else ""


def test_no_second_resolver():
    found = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and rel not in ("model/job.py", "data/catalog.py"):
                name = _called(node)
                # the catalog's spec, or a spec counted from a config with no built model to count
                if name == "catalog.spec" or (name == "model_spec" and len(node.args) < 2 and rel != "memfit/hf.py"):
                    found.append(f"{rel}:{node.lineno}: {name}")
        for node in tree.body:  # module-level functions (a method such as a GPU check's row builder is not one)
            if isinstance(node, ast.FunctionDef) and node.name in RESOLVER_NAMES and rel != "model/job.py":
                found.append(f"{rel}:{node.lineno}: def {node.name}")
    assert found == []


def test_the_defaults_live_once_in_the_schema():
    found = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "default_data_parallel_size":
                found.append(f"{rel}: def default_data_parallel_size")
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "DEFAULT_LORA_RANK" for t in node.targets
            ):
                found.append(f"{rel}: DEFAULT_LORA_RANK =")
            # a LoRA rank written as a number: fields["lora_rank"] = 8, lora_rank=8
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and type(node.value.value) is int
                and any(
                    isinstance(t, ast.Subscript) and getattr(t.slice, "value", None) == "lora_rank"
                    for t in node.targets
                )
            ):
                found.append(f"{rel}:{node.lineno}: lora_rank = {node.value.value}")
    assert sorted(found) == [
        "memfit/schema.py: DEFAULT_LORA_RANK =",
        "memfit/schema.py: def default_data_parallel_size",
    ]


def test_the_architecture_is_resolved_once_per_catalog_name():
    assert isinstance(resolve_architecture("gpt2"), Architecture)
    assert resolve("gpt2", TrainingConfig(micro_batch_size=1, seq_len=64)).architecture is resolve_architecture("gpt2")


def test_the_meta_build_facts_on_the_architecture_and_the_job():
    # llama-3-8b: embeddings and head 2 x 128256 x 4096 plus the final norm outside the layers; per layer the seven
    # projections and two norms (9 tensors); 1,050,677,248 + 32 x 218,112,000 = the published 8,030,261,248
    split = resolve_architecture("llama-3-8b").parameter_split
    assert tuple(split) == (1_050_677_248, 218_112_000, 9)
    assert split.outside + 32 * split.layer == LLAMA_3_8B_PARAMS
    # Mixtral-8x7B over four expert-parallel ranks: each builds 2 of the 8 experts of every MoE layer, so a rank
    # holds 46.70 B less, in each of 32 layers, 6 experts of 3 x 4096 x 14336 and their 6 router rows of 4096
    job = resolve(
        "mixtral-8x7b", TrainingConfig(micro_batch_size=1, seq_len=64, data_parallel_size=4, expert_parallel_size=4)
    )
    assert job.hf_config["num_local_experts"] == 8 and job.rank_hf_config["num_local_experts"] == 2
    assert job.spec.total_params - job.rank_spec.total_params == 32 * 6 * (176_160_768 + 4096)

"""Property-based API testing from the OpenAPI spec: no input may produce a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from service.app import create_app  # noqa: E402
from service.settings import Settings  # noqa: E402


@pytest.fixture(scope="module")
def app(small_registry, tmp_path_factory):
    db = tmp_path_factory.mktemp("st") / "t.db"
    return create_app(Settings(db_url=f"sqlite:///{db}", registry_dir=str(small_registry.root), warm_up=False))


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(app, mode):
    """Data that fits the schema (positive) and data that breaks it (negative: wrong types, out of
    range, missing fields): never a 5xx."""
    from hypothesis import given
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    seen, statuses = [], []
    for result in schema.get_all_operations():
        op = result.ok()
        seen.append(f"{op.method.upper()} {op.path}")
        if mode == "negative" and not len(op.body):  # nothing to break in an operation without a body
            continue

        @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def run(case):
            statuses.append(case.call_and_validate(checks=[not_a_server_error]).status_code)

        run()
    assert {"POST /recommend", "POST /predict", "POST /telemetry"} <= set(seen)
    assert len(statuses) >= 75 and max(statuses) < 500
    if mode == "negative":
        assert sum(400 <= s < 500 for s in statuses) >= 50

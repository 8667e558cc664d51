"""benchmarks.ratio_seeds: bad input is refused before any fit; one seed's line is the accuracy benchmark's."""

from __future__ import annotations

import pytest

from benchmarks import ratio_seeds


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--files", "no/such.parquet"], "no/such.parquet"),
        (["--params", '{"random_state": 3}'], "must not set random_state"),
        (["--params", '{"num_leafs": 3}'], "num_leafs"),
        (["--params", "[1]"], "JSON object"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(argv, message, capsys):
    assert ratio_seeds.main(argv) == 2
    assert message in capsys.readouterr().err


def test_negative_seed_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        ratio_seeds.main(["--seeds", "-1"])
    assert exc.value.code == 2 and "--seeds must be >= 0" in capsys.readouterr().err

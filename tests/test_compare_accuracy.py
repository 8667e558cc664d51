"""benchmarks.compare_accuracy: figure-by-figure comparison of two printed accuracy outputs."""

from pathlib import Path

from benchmarks.compare_accuracy import compare, main, parse_output

BASE = Path("benchmarks/results/accuracy_cb47173_rerun.txt")

OUT = """\
leave_architecture_out:
  path (rows)                    n   MAPE %   p95 %   max %  saving%  cover% excess% exactk%  OOM% noFit%
  provisional on every row   15168    {mape}   21.87   72.35   16.665    {cover}   19.82    92.8   0.1    1.4
  analytic formula           15168   14.125   33.23   83.38   27.463    23.3   {excess}    94.5   4.7    0.2
  served provisional rows        0      nan     nan     nan      nan     nan     nan     nan   nan    nan
    fp32/sgd_momentum                n=  245  provisional    {slice} beats  analytic    9.22  learned    2.42 beats
"""


def _write(tmp_path, name, **kw):
    figures = {"mape": "6.999", "cover": "95.5", "excess": "-9.72", "slice": "8.56", **kw}
    path = tmp_path / name
    path.write_text(OUT.format(**figures))
    return str(path)


def test_a_shipped_output_parses_into_every_figure_and_equals_itself():
    figures = parse_output(BASE.read_text())
    assert figures[("leave_architecture_out", "provisional on every row", "max")] == 72.35
    assert figures[("small_to_large", "analytic formula", "OOM")] == 56.2
    assert ("small_to_large", "served provisional rows", "MAPE") not in figures  # printed nan
    assert figures[("leave_architecture_out", "slice fp32/sgd_momentum", "learned")] == 2.40
    better, same, worse = compare(figures, figures)
    assert (better, worse) == (0, []) and same == len(figures) > 150
    assert main([str(BASE), str(BASE)]) == 0


def test_each_column_is_judged_in_its_own_direction(tmp_path, capsys):
    base = _write(tmp_path, "base.txt")
    # lower MAPE, higher cover, an excess nearer zero: all better
    assert main([base, _write(tmp_path, "better.txt", mape="6.435", cover="96.0", excess="-5.19")]) == 0
    assert "better 3, unchanged 18, worse 0" in capsys.readouterr().out
    # lower cover and a higher slice MAPE are worse; the row with nan figures is skipped
    assert main([base, _write(tmp_path, "worse.txt", cover="95.2", slice="10.20")]) == 1
    out = capsys.readouterr().out
    assert "worse 2" in out
    assert "leave_architecture_out | provisional on every row | cover: 95.5 -> 95.2" in out
    assert "leave_architecture_out | slice fp32/sgd_momentum | provisional: 8.56 -> 10.2" in out


def test_bad_input_exits_2_naming_the_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("no figures here\n")
    assert main([str(BASE), str(empty)]) == 2
    assert f"{empty}: no benchmarks.accuracy figures" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.txt"), str(BASE)]) == 2
    assert "missing.txt" in capsys.readouterr().err

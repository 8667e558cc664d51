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
    optimizer lion                   n=    5  MAPE   0.00  p95   0.00  cover {lion_cover}  traced/provisional 5/0

default: smallest cap within 2 % or 256 MiB 8 of 24 (error median {cap_err} MiB, range -8001..+368); reserved within \
tolerance 21 of 24
"""


def _write(tmp_path, name, **kw):
    figures = {
        "mape": "6.999",
        "cover": "95.5",
        "excess": "-9.72",
        "slice": "8.56",
        "lion_cover": "100.0",
        "cap_err": "-540",
    }
    path = tmp_path / name
    path.write_text(OUT.format(**{**figures, **kw}))
    return str(path)


def test_a_shipped_output_parses_into_every_figure_and_equals_itself():
    figures = parse_output(BASE.read_text())
    assert figures[("leave_architecture_out", "provisional on every row", "max")] == 72.35
    assert figures[("small_to_large", "analytic formula", "OOM")] == 56.2
    assert ("small_to_large", "served provisional rows", "MAPE") not in figures  # printed nan
    assert figures[("leave_architecture_out", "slice fp32/sgd_momentum", "learned")] == 2.40
    shipped = parse_output(Path("benchmarks/results/accuracy.txt").read_text())
    assert shipped[("leave_architecture_out", "setting tensor_parallel_size > 1", "cover")] == 100.0
    assert shipped[("reserved", "default", "caps within tolerance")] == 8
    assert shipped[("reserved", "expandable", "cap error median MiB")] == -242
    better, same, worse = compare(figures, figures)
    assert (better, worse) == (0, []) and same == len(figures) > 150
    assert main([str(BASE), str(BASE)]) == 0


def test_each_column_is_judged_in_its_own_direction(tmp_path, capsys):
    base = _write(tmp_path, "base.txt")
    # lower MAPE, higher cover, an excess and a cap error nearer zero: all better
    better = _write(tmp_path, "better.txt", mape="6.435", cover="96.0", excess="-5.19", cap_err="+300")
    assert main([base, better]) == 0
    assert "better 4, unchanged 23, worse 0" in capsys.readouterr().out
    # lower cover and a higher slice MAPE are worse; the row with nan figures is skipped
    assert main([base, _write(tmp_path, "worse.txt", cover="95.2", slice="10.20", lion_cover="99.0")]) == 1
    out = capsys.readouterr().out
    assert "worse 3" in out
    assert "leave_architecture_out | setting optimizer lion | cover: 100 -> 99" in out
    assert "leave_architecture_out | provisional on every row | cover: 95.5 -> 95.2" in out
    assert "leave_architecture_out | slice fp32/sgd_momentum | provisional: 8.56 -> 10.2" in out


def test_bad_input_exits_2_naming_the_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("no figures here\n")
    assert main([str(BASE), str(empty)]) == 2
    assert f"{empty}: no benchmarks.accuracy figures" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.txt"), str(BASE)]) == 2
    assert "missing.txt" in capsys.readouterr().err

"""Figure by figure: is every number of one ``python -m benchmarks.accuracy`` output unchanged or better than another's?

    python -m benchmarks.compare_accuracy benchmarks/results/accuracy_cb47173_rerun.txt benchmarks/results/accuracy.txt

Reads the printed output (what ``benchmarks/results/`` keeps for every tree, old ones included): per split, each path
row's columns (:data:`benchmarks.accuracy.HEADER`), the per-slice MAPEs of the provisional, analytic and learned paths
and the served curve's MAPE, p95 and cover per setting; then the reserved-memory summary per allocator setting (how many
smallest caps and reserved peaks within tolerance, the median cap error). A figure is better when it is lower, except
cover, exact-k and the within-tolerance counts (higher) and excess and the median cap error (nearer to zero: the
analytic formula's excess is negative, its bias). Figures compared at the printed precision. Prints the counts and
every worse figure as ``split | row | figure: base -> new``.

Exit codes: 0 nothing worse, 1 some figure worse, 2 bad input (a missing file, or one with no figures).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks.accuracy import COLUMNS as ACCURACY_COLUMNS

COLUMNS = tuple(name for name, _ in ACCURACY_COLUMNS)
HIGHER_IS_BETTER = frozenset({"cover", "exact-k", "caps within tolerance", "reserved within tolerance"})
NEARER_ZERO_IS_BETTER = frozenset({"excess", "cap error median MiB"})
_SPLIT = re.compile(r"^(leave_architecture_out|small_to_large):")
#: a path row: its name, n, then one figure per column
_PATH_ROW = re.compile(r"^  ([a-z][a-z ()]+?)\s+\d+" + r"\s+(\S+)" * len(COLUMNS) + r"$")
_SLICE = re.compile(r"^    (\S+/\S+)\s+n=\s*\d+\s+provisional\s+(\S+) \w+\s+analytic\s+(\S+)\s+learned\s+(\S+)")
_SETTING = re.compile(r"^    (.+?)\s+n=\s*\d+\s+MAPE\s+(\S+)\s+p95\s+(\S+)\s+cover\s+(\S+)\s+traced/provisional")
_RESERVED = re.compile(
    r"^(\S+): smallest cap within .*? (\d+) of \d+ \(error median (\S+) MiB.*reserved within tolerance (\d+) of \d+"
)

#: (split, row, figure) -> value
Figures = dict[tuple[str, str, str], float]


def parse_output(text: str) -> Figures:
    """The figures of one ``benchmarks.accuracy`` output; ``nan`` figures (a path with no rows) are left out."""
    out: Figures = {}
    split = None
    for line in text.splitlines():
        if m := _SPLIT.match(line):
            split = m.group(1)
        elif m := _RESERVED.match(line):
            names = ("caps within tolerance", "cap error median MiB", "reserved within tolerance")
            for name, value in zip(names, m.groups()[1:], strict=True):
                out[("reserved", m.group(1), name)] = float(value)
        elif split is None:
            continue
        elif m := _PATH_ROW.match(line):
            for column, value in zip(COLUMNS, m.groups()[1:], strict=True):
                if value != "nan":
                    out[(split, m.group(1), column)] = float(value)
        elif m := _SLICE.match(line):
            for path, value in zip(("provisional", "analytic", "learned"), m.groups()[1:], strict=True):
                out[(split, f"slice {m.group(1)}", path)] = float(value)
        elif m := _SETTING.match(line):
            for column, value in zip(("MAPE", "p95", "cover"), m.groups()[1:], strict=True):
                out[(split, f"setting {m.group(1)}", column)] = float(value)
    return out


def is_better(figure: str, base: float, new: float) -> bool:
    """Whether ``new`` improves on ``base`` for this column (see the module docstring)."""
    if figure in HIGHER_IS_BETTER:
        return new > base
    if figure in NEARER_ZERO_IS_BETTER:
        return abs(new) < abs(base)
    return new < base


def compare(base: Figures, new: Figures) -> tuple[int, int, list[tuple[tuple[str, str, str], float, float]]]:
    """(better, unchanged, worse figures as (key, base, new)) over the figures both outputs have."""
    better = same = 0
    worse = []
    for key in sorted(set(base) & set(new)):
        b, n = base[key], new[key]
        if b == n:
            same += 1
        elif is_better(key[2], b, n):
            better += 1
        else:
            worse.append((key, b, n))
    return better, same, worse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="printed output of python -m benchmarks.accuracy: the baseline")
    p.add_argument("new", help="printed output of python -m benchmarks.accuracy: the tree to judge")
    a = p.parse_args(argv)
    parsed = []
    for path in (a.base, a.new):
        try:
            figures = parse_output(Path(path).read_text())
        except OSError as err:
            print(f"error: {path}: {err.strerror}", file=sys.stderr)
            return 2
        if not figures:
            print(f"error: {path}: no benchmarks.accuracy figures in it", file=sys.stderr)
            return 2
        parsed.append(figures)
    base, new = parsed
    better, same, worse = compare(base, new)
    only = len(set(base) ^ set(new))
    print(f"better {better}, unchanged {same}, worse {len(worse)} (figures in one output only: {only})")
    for (split, row, figure), b, n in worse:
        print(f"  {split} | {row} | {figure}: {b:g} -> {n:g}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())

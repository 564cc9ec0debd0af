"""Warp-stall and instruction summary of an Nsight Compute source page (no GPU needed).

Input: the CSV that ``ncu --import REPORT.ncu-rep --page source --csv --print-source sass`` writes (first line
the kernel name, second the header, then one row per SASS instruction with its ``stall_*`` samples and
``Instructions Executed``). Prints the share of each stall reason over all samples, the opcodes that collect
the most samples of the main reasons, and the executed-instruction mix::

    python benchmarks/ncu_summary.py benchmarks/results/h200_run14_ncu/sass_b13.csv

(`benchmarks/results/h200_run14_ncu/stall_summary.txt` is this output for the B=13 and B=3 profiles.)
"""
from __future__ import annotations

import argparse
import collections
import csv

REASONS = ("stall_long_sb", "stall_short_sb", "stall_mio", "stall_wait", "stall_barrier", "stall_math",
           "stall_not_selected", "stall_selected", "stall_dispatch", "stall_lg")


def _num(text: str) -> float:
    return float(text.replace(",", "") or 0)


def _opcode(sass: str) -> str:
    words = sass.split()
    op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
    return op.split(".")[0]


def summarize(path: str) -> str:
    """The summary text of one source-page CSV. Raises ValueError if it has no ``stall_*`` columns."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], [r for r in rows[2:] if len(r) == len(rows[1])]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    if not stalls:
        raise ValueError(f"{path}: no stall_* columns; export with --page source --csv --print-source sass")
    total, by_op, executed = collections.Counter(), collections.defaultdict(collections.Counter), collections.Counter()
    for r in data:
        op = _opcode(r[col["Source"]].strip())
        executed[op] += int(_num(r[col["Instructions Executed"]]))
        for s in stalls:
            v = _num(r[col[s]])
            total[s] += v
            by_op[op][s] += v
    n = sum(total.values())
    out = [f"{path}: {n:.0f} stall samples"]
    out += [f"  {s:24s} {100 * v / n:5.1f}%" for s, v in total.most_common(12)]
    for s in REASONS:
        top = sorted(((c[s], op) for op, c in by_op.items()), reverse=True)[:5]
        out.append(f"  {s}: " + ", ".join(f"{op} {100 * v / n:.1f}%" for v, op in top if v > 0))
    e = sum(executed.values())
    out.append(f"  executed {e}  top: " + ", ".join(f"{o} {100 * v / e:.1f}%" for o, v in executed.most_common(16)))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", help="source-page CSV(s) exported by ncu")
    for path in ap.parse_args(argv).csv:
        print(summarize(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

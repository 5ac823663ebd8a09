#!/usr/bin/env python3
"""The SASS instructions of one profiled kernel where its warps stalled most.

Reads Nsight Compute's source page as CSV (`ncu -i REPORT --page source --csv --print-source sass`,
collected with `--section SourceCounters`) and prints the columns it found, the kernel's samples
by stall reason (the columns named "stall_*" or "... Stall ..." when the report has them), then
the `--top` instructions by warp-stall samples, each with its share of all samples, the
instruction and the stall reasons that make up its samples. The ncu suite of bench/device/run.sh
runs it with SOURCE=regex.
  python3 bench/ncu_source_top.py source.csv --top 40
"""
import argparse
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_path")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.csv_path, newline="") as handle:
        lines = [line for line in handle if line.strip()]
    # ncu may print a line per kernel before the table: the table starts at the first line with
    # a quoted "Address" or "Source" header.
    start = next((i for i, line in enumerate(lines) if '"Source"' in line or '"Address"' in line),
                 0)
    rows = list(csv.reader(lines[start:]))
    header, body = rows[0], [row for row in rows[1:] if len(row) == len(rows[0])]
    print("columns:", " | ".join(header))
    sampled = [i for i, name in enumerate(header) if "Sampling" in name and "All" in name]
    if not sampled:
        sampled = [i for i, name in enumerate(header) if "Sampling" in name]
    if not sampled:
        print("no warp-stall sampling column")
        return 1
    samples_column = sampled[0]
    source_column = header.index("Source") if "Source" in header else 1
    reason_columns = [i for i, name in enumerate(header)
                      if name.startswith("stall_") or ("Stall" in name and "Sampling" not in name)]
    total = sum(number(row[samples_column]) for row in body) or 1.0
    print(f"{header[samples_column]}: {total:.0f} samples over {len(body)} instructions")
    # The whole kernel's samples by stall reason (the "Not Issued" columns are a subset).
    by_reason = sorted(((sum(number(row[i]) for row in body), header[i]) for i in reason_columns
                        if "Not Issued" not in header[i]), reverse=True)
    print("by reason: " + ", ".join(f"{name} {100 * value / total:.1f}%"
                                    for value, name in by_reason[:10] if value > 0))
    ranked = sorted(body, key=lambda row: number(row[samples_column]), reverse=True)
    for row in ranked[:args.top]:
        samples = number(row[samples_column])
        reasons = sorted(((number(row[i]), header[i]) for i in reason_columns), reverse=True)
        named = ", ".join(f"{name} {value:.0f}" for value, name in reasons[:3] if value > 0)
        address = row[0] if header[0] != "Source" else ""
        print(f"{100 * samples / total:5.1f}% {samples:7.0f} {address} {row[source_column][:70]}"
              f"  [{named}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

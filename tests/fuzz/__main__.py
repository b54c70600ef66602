"""``python -m tests.fuzz [--cases N] [--target NAME] [--json OUT]``: the fuzzer at scale, figures for the README."""

from __future__ import annotations

import argparse
import json
import resource
import sys

from tests.fuzz import all_targets, run_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz")
    parser.add_argument("--cases", type=int, default=20000, help="cases per target (default 20000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", action="append", default=[], help="only these targets (repeatable)")
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    args = parser.parse_args(argv)
    import obs._core.internal as internal

    internal.set_raise_internal_errors(True)
    rows = []
    for target in all_targets():
        if args.target and target.name not in args.target:
            continue
        report = run_target(target, args.cases, seed=args.seed)
        rows.append({"target": report.target, "cases": report.cases, "rejected": report.rejected,
                     "tracebacks": report.tracebacks, "findings": dict(report.findings),
                     "seconds": round(report.seconds, 1)})
        print(f"{report.target:24} {report.cases:8} cases  {report.rejected:8} rejected  "
              f"{report.tracebacks:6} tracebacks  {report.seconds:7.1f} s", flush=True)
        for key, text in report.examples.items():
            print(f"  {key}: {report.findings[key]}\n    " + text.replace("\n", "\n    ")[:3000], file=sys.stderr)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak_mib:.0f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cases_per_target": args.cases, "seed": args.seed, "peak_rss_mib": round(peak_mib),
                       "targets": rows}, fh, indent=2)
    return 1 if any(row["tracebacks"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the test suite's time goes: every trace, lowering and XLA compile of a pytest run
(jaxpar.testing.CompileLog, through tests/conftest.py), summed by kind, by program, by test
file and by test, beside pytest's own durations.

  python benchmarks/suite_compiles.py                        # the whole suite, as the README runs it
  python benchmarks/suite_compiles.py tests/equivalence/test_zero.py -n 0   # any pytest arguments
  python benchmarks/suite_compiles.py --logs DIR --pytest-output FILE   # summarise an earlier run
  ... [--out benchmarks/results/suite_compiles.json] [--top 15]

Only the test processes are logged (the xdist workers), not the processes a test starts
(`jaxpar train` children, two-process runs): their time is in the durations alone. A
program loaded from the run's compilation cache counts as a compile of milliseconds.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
DURATION = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S.*)$")
SUMMARY = re.compile(r"(\d+) passed.* in ([\d.]+)s")


def run_pytest(args: list[str], logs: pathlib.Path) -> str:
    """pytest's output (shown as it runs), with every duration listed."""
    env = {**os.environ, "JAXPAR_COMPILE_LOG": str(logs)}
    command = [sys.executable, "-m", "pytest", "-q", "--durations=0", "-p", "no:cacheprovider", *args]
    lines = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            if not DURATION.match(line):  # the durations go to the tables, not the screen
                sys.stdout.write(line)
            lines.append(line)
    return "".join(lines)


def durations(output: str) -> dict[str, float]:
    """test id -> seconds (setup, call and teardown summed)."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in output.splitlines():
        found = DURATION.match(line)
        if found:
            out[found.group(3)] += float(found.group(1))
    return dict(out)


def read_logs(logs: pathlib.Path) -> list[dict]:
    return [json.loads(line) for f in sorted(logs.glob("*.jsonl")) for line in f.read_text().splitlines() if line]


def summary(records: list[dict], times: dict[str, float], output: str, top: int) -> dict:
    kinds = collections.Counter()
    programs: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    per_test: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
    for r in records:
        kinds[r["kind"]] += r["s"]
        if r["kind"] == "compile":
            programs[r["fn"]][0] += 1
            programs[r["fn"]][1] += r["s"]
            per_test[r["test"]][0] += 1
            per_test[r["test"]][2][r["fn"]] += r["s"]
        per_test[r["test"]][1] += r["s"]
    files = collections.defaultdict(lambda: [0.0, 0.0])
    for test, seconds in times.items():
        files[test.split("::")[0]][0] += seconds
    for test, (_, seconds, _) in per_test.items():
        files[test.split("::")[0]][1] += seconds
    found = SUMMARY.search(output)
    tests = sorted(times, key=times.get, reverse=True)[:top]
    return {
        "passed": int(found.group(1)) if found else None,
        "wall_s": float(found.group(2)) if found else None,
        "test_seconds_summed": round(sum(times.values()), 1),
        "jax_seconds_by_kind": {k: round(v, 1) for k, v in kinds.most_common()},
        "programs": [{"program": fn, "compiles": n, "seconds": round(s, 1)}
                     for fn, (n, s) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:top]],
        "files": [{"file": f, "test_seconds": round(t, 1), "jax_seconds": round(j, 1)}
                  for f, (t, j) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]],
        "tests": [{"test": t, "seconds": round(times[t], 1), "compiles": per_test[t][0],
                   "jax_seconds": round(per_test[t][1], 1),
                   "largest": [[fn, round(s, 1)] for fn, s in per_test[t][2].most_common(2)]} for t in tests],
    }


def print_tables(s: dict) -> None:
    print(f"\n{s['passed']} passed in {s['wall_s']} s; the tests' durations sum to {s['test_seconds_summed']} s")
    print("\nJAX's time in the test processes, by kind (s):")
    for kind, seconds in s["jax_seconds_by_kind"].items():
        print(f"  {kind:<10} {seconds:>8.1f}")
    rows = [("program", "compiles", "s")] + [(p["program"][:40], p["compiles"], p["seconds"]) for p in s["programs"]]
    print("\nXLA compiles by program:")
    for name, n, sec in rows:
        print(f"  {name:<40} {n:>8} {sec:>8}")
    print("\nby test file (durations; JAX's traces, lowerings and compiles in them):")
    for f in s["files"]:
        print(f"  {f['file']:<44} {f['test_seconds']:>8.1f} {f['jax_seconds']:>8.1f}")
    print("\nthe slowest tests:")
    for t in s["tests"]:
        largest = ", ".join(f"{fn} {sec}" for fn, sec in t["largest"])
        print(f"  {t['seconds']:>6.1f} s  {t['compiles']:>3} compiles ({largest})  {t['test'][:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", type=pathlib.Path, help="an earlier run's CompileLog folder (nothing is run)")
    parser.add_argument("--pytest-output", type=pathlib.Path, help="with --logs: that run's pytest output")
    parser.add_argument("--out", type=pathlib.Path, help="write the summary as JSON here")
    parser.add_argument("--top", type=int, default=15)
    args, pytest_args = parser.parse_known_args(argv)
    if args.logs:
        if not args.pytest_output:
            parser.error("--logs needs --pytest-output, the output of the run that wrote them")
        logs, output = args.logs, args.pytest_output.read_text()
    else:
        logs = pathlib.Path(tempfile.mkdtemp(prefix="jaxpar-compile-log-"))
        output = run_pytest(pytest_args, logs)
    s = summary(read_logs(logs), durations(output), output, args.top)
    print_tables(s)
    if args.out:
        s = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
             "pytest_args": pytest_args, **s}
        args.out.write_text(json.dumps(s, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return 0 if s["passed"] is not None and "failed" not in output.splitlines()[-1] else 1


if __name__ == "__main__":
    sys.exit(main())

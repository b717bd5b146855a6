"""Time per test module from a pytest JUnit XML report: where the suite's minutes go.

    .venv/bin/python -m pytest -q --junitxml=/tmp/suite.xml     # the README's test command, plus a report
    .venv/bin/python tools/suite_times.py /tmp/suite.xml [--top 10] [--markdown]

pytest's ``--junitxml`` records each test's time including its share of fixture set-up (a module's
shared fixture is counted in the first test that needs it), so the sum per module is what running that
module costs. Prints the modules slowest first with their test counts, outcomes, seconds and share of the
whole, then the slowest single tests. ``--markdown`` prints the table docs/testing.md keeps.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def module_of(case: ET.Element) -> str:
    """``tests/test_x.py`` of a testcase element (``classname`` is ``tests.test_x`` or ``tests.test_x.Class``)."""
    parts = case.get("classname", "").split(".")
    names = [p for p in parts if p.startswith("test_")]
    return f"tests/{names[0]}.py" if names else ".".join(parts) or "?"


def outcome(case: ET.Element) -> str:
    for kind in ("failure", "error", "skipped"):
        if case.find(kind) is not None:
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
    return "passed"


def read_report(path: str) -> tuple[dict, list]:
    """``{module: {"seconds", "tests", outcome: count}}`` and ``[(seconds, test id)]``."""
    root = ET.parse(path).getroot()
    modules: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    tests = []
    for case in root.iter("testcase"):
        seconds = float(case.get("time", 0) or 0)
        module = module_of(case)
        modules[module]["seconds"] += seconds
        modules[module]["tests"] += 1
        modules[module][outcome(case)] += 1
        tests.append((seconds, f"{module}::{case.get('name')}"))
    return modules, sorted(tests, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a pytest --junitxml file")
    parser.add_argument("--top", type=int, default=10, help="slowest single tests to list (default 10)")
    parser.add_argument("--markdown", action="store_true", help="the module table as Markdown")
    args = parser.parse_args(argv)
    try:
        modules, tests = read_report(args.report)
    except (OSError, ET.ParseError) as exc:
        print(f"suite_times: error: {args.report}: {exc}", file=sys.stderr)
        return 1
    total = sum(m["seconds"] for m in modules.values()) or 1.0
    order = sorted(modules.items(), key=lambda kv: -kv[1]["seconds"])
    if args.markdown:
        print("| module | tests | seconds | share |\n|---|---:|---:|---:|")
        for name, m in order:
            print(f"| {name} | {int(m['tests'])} | {m['seconds']:.0f} | {100 * m['seconds'] / total:.1f}% |")
        return 0
    print(f"{'module':48} {'tests':>6} {'passed':>7} {'skipped':>8} {'failed':>7} {'seconds':>8} {'share':>6}")
    for name, m in order:
        failed = int(m["failed"] + m["error"])
        print(f"{name:48} {int(m['tests']):6d} {int(m['passed']):7d} {int(m['skipped']):8d} {failed:7d} "
              f"{m['seconds']:8.0f} {100 * m['seconds'] / total:5.1f}%")
    print(f"{'total':48} {sum(int(m['tests']) for m in modules.values()):6d} {'':7} {'':8} {'':7} {total:8.0f}")
    print(f"\nslowest {args.top} tests:")
    for seconds, name in tests[:args.top]:
        print(f"{seconds:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

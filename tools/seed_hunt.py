"""Run the CPU test suite under several base seeds and print which tests failed under which.

    python tools/seed_hunt.py --seeds 1-10 [-- extra pytest args, e.g. tests/ops]

Every test seeds torch, random and numpy from (KDASERVE_TEST_SEED, its id) (tests/conftest.py), so
a failure here reproduces with the seed the table names. Results go to --out (one JUnit XML per
seed) and the table is printed last.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def failures(junit: Path) -> dict[str, str]:
    """test id -> first line of its failure or error message."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            test_id = f"{case.get('classname')}::{case.get('name')}"
            found[test_id] = (bad.get("message") or "").splitlines()[0][:100] if bad.get("message") else bad.tag
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1-10", help="base seeds: '1-10', '3,7,11-12'")
    ap.add_argument("--out", type=Path, default=Path("out/seed_hunt"))
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest after '--' (default: the whole suite)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    by_test: dict[str, dict[int, str]] = defaultdict(dict)
    rows = []
    for seed in parse_seeds(args.seeds):
        junit = args.out / f"seed_{seed}.xml"
        env = dict(os.environ, KDASERVE_TEST_SEED=str(seed), TRITON_INTERPRET="1")
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                               *args.pytest_args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = failures(junit) if junit.exists() else {"<no junit report>": f"pytest exited {proc.returncode}"}
        for test_id, message in found.items():
            by_test[test_id][seed] = message
        rows.append((seed, proc.returncode, len(found), time.monotonic() - start))
        print(f"seed {seed}: exit {proc.returncode}, {len(found)} failed, {rows[-1][3]:.0f} s", flush=True)
    print("\n| seed | pytest exit | failed | seconds |\n|---|---|---|---|")
    for seed, rc, n, secs in rows:
        print(f"| {seed} | {rc} | {n} | {secs:.0f} |")
    if by_test:
        print("\n| test | failed under seeds | first message |\n|---|---|---|")
        for test_id, seeds in sorted(by_test.items()):
            first = next(iter(seeds.values()))
            print(f"| {test_id} | {','.join(map(str, seeds))} | {first} |")
    else:
        print("\nno test failed under any seed")
    return 1 if by_test else 0


if __name__ == "__main__":
    sys.exit(main())

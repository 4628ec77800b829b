#!/usr/bin/env python3
"""A rolling restart's wall time by batch size: `fab restart --role ROLE` of a pool under
steady load, once for each gpufleet_max_unavailable given. Prints one JSON document.

    python3 bench/roll.py -i INVENTORY --role decode [--sizes 1,2,3] [--concurrency 4]

INVENTORY is a deployed gpufleet_workers deployment (fab deploy -i INVENTORY); its
group_vars/all.yml gets gpufleet_max_unavailable: {ROLE: SIZE} for each run and its own
value back at the end (a batch size changes no unit, so no deploy is needed between
runs). The load: CONCURRENCY clients sending one chat request after the other (8 tokens,
no retries, the official openai client) from 3 s before the restart to 3 s after it.
Reported per size: the restart's batches, its wall seconds, requests and failed ones.
Runs on the controller (the lab's, or a site's with ssh access to its hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_out import FAB, ROOT, client, under_load  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-i", "--inventory", required=True)
    p.add_argument("--role", required=True, help="the pool's role, e.g. decode or worker")
    p.add_argument("--sizes", default="1,2", help="gpufleet_max_unavailable values, in order")
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()

    all_yml = Path(args.inventory) / "group_vars" / "all.yml"
    original = all_yml.read_text()
    values = yaml.safe_load(original) or {}
    openai, name = client(args.inventory)
    runs = []
    run: dict = {}  # the last restart's process and wall seconds

    def restart() -> None:
        started = time.monotonic()
        run["done"] = subprocess.run([FAB, "restart", "--role", args.role, "-i", args.inventory],
                                     cwd=ROOT, capture_output=True, text=True)
        run["took"] = time.monotonic() - started

    try:
        for size in args.sizes.split(","):
            size = int(size) if size.isdigit() else size
            all_yml.write_text(yaml.safe_dump(
                {**values, "gpufleet_max_unavailable": {args.role: size}}))
            results, _, _ = under_load(openai, name, args.concurrency, restart, lead=3, tail=3)
            done, took = run["done"], run["took"]
            failed = sum(1 for _, error in results if error)
            if done.returncode:
                print(done.stdout[-3000:], done.stderr[-2000:], file=sys.stderr)
            batches = sorted({int(b) for b in re.findall(r"Roll \| Restart, batch (\d+)",
                                                          done.stdout)})
            runs.append({"max_unavailable": size, "rc": done.returncode,
                         "batches": len(batches), "wall_s": round(took, 1),
                         "requests": len(results), "failed": failed,
                         "errors": sorted({e for _, e in results if e})[:3]})
            print(json.dumps(runs[-1]), file=sys.stderr)
    finally:
        all_yml.write_text(original)
    print(json.dumps({"role": args.role, "concurrency": args.concurrency, "runs": runs},
                     indent=2))
    return 0 if all(r["rc"] == 0 and r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""A healthy deployment left alone: how many health runs went red. Prints one JSON document.

    python3 bench/health_soak.py [--hosts lab1,lab2] [--minutes 60]

Run on the lab's controller with a deployment up and no fault injected. It notes the time,
waits, then reads every host's journal for the runs of the timer's checker
(gpufleet-health.service) and of the watcher (gpufleet-health-watch.service) since then:
each run ends with "HOST: healthy in ..." or "HOST: UNHEALTHY in ...". Goal (fleet health
issue): 0 red runs in an hour. A red run's failing lines are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "lab"))
from gpufleet_lab import hosts  # noqa: E402 - the lab package lives beside the bench

UNITS = ("gpufleet-health.service", "gpufleet-health-watch.service")


def journal(host, unit, since):
    proc = subprocess.run(hosts.ssh_cmd(host, f"journalctl -u {unit} --since=@{int(since)} "
                                        "-o cat --no-pager"), capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"{host}: journalctl -u {unit}: {proc.stderr.strip()}")
    return proc.stdout.splitlines()


def runs(lines):
    """(healthy, red, the failing lines of each red run) from a checker's log."""
    healthy, red, failing, current = 0, 0, [], []
    for line in lines:
        if line.startswith(("FAIL", "ERR")):
            current.append(line)
        if re.match(r"^\S+: (healthy|UNHEALTHY) in [\d.]+s$", line):
            if "UNHEALTHY" in line:
                red += 1
                failing.append(current)
            else:
                healthy += 1
            current = []
    return healthy, red, failing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="lab1")
    parser.add_argument("--minutes", type=float, default=60)
    args = parser.parse_args()
    names = args.hosts.split(",")
    since = time.time()
    time.sleep(args.minutes * 60)
    out = {"minutes": args.minutes, "hosts": {}}
    for host in names:
        out["hosts"][host] = {}
        for unit in UNITS:
            healthy, red, failing = runs(journal(host, unit, since))
            out["hosts"][host][unit] = {"healthy_runs": healthy, "red_runs": red,
                                        "red": failing[:5]}
    out["red_runs"] = sum(u["red_runs"] for h in out["hosts"].values() for u in h.values())
    print(json.dumps(out, indent=1))
    return 1 if out["red_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())

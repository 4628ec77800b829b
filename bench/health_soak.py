#!/usr/bin/env python3
"""A healthy deployment left alone: how many health runs went red. Prints one JSON document.

    python3 bench/health_soak.py [--hosts lab1,lab2] [--minutes 60]

Run on the lab's controller with a deployment up and no fault injected. It notes the time,
waits, then reads every host's journal for the runs of the timer's checker
(gpufleet-health.service) and of the watcher (gpufleet-health-watch.service) since then:
each run ends with "HOST: healthy in ..." or "HOST: UNHEALTHY in ...". Goal (fleet health
issue): 0 red runs in an hour. A red run's failing lines are printed with it, and so is every
gpufleet unit whose restart count rose over the hour (a checker that restarts a unit is not
a quiet one, whatever colour its runs were).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from health_watch import lab_ssh  # the bench's one way to run a command on a lab host

UNITS = ("gpufleet-health.service", "gpufleet-health-watch.service")


def journal(ssh, unit, since):
    return ssh(f"journalctl -u {unit} --since=@{int(since)} -o cat --no-pager").splitlines()


def restarts(ssh):
    """{unit: NRestarts} of a host's gpufleet units."""
    show = ssh("systemctl show -p Id,NRestarts 'gpufleet-*.service'")
    units = [dict(line.split("=", 1) for line in block.splitlines())
             for block in show.strip().split("\n\n") if block]
    return {unit["Id"]: int(unit["NRestarts"]) for unit in units}


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
    ssh = {host: lab_ssh(host)[1] for host in names}
    before = {host: restarts(ssh[host]) for host in names}
    since = time.time()
    time.sleep(args.minutes * 60)
    out = {"minutes": args.minutes, "hosts": {}}
    for host in names:
        after = restarts(ssh[host])
        out["hosts"][host] = {"units": len(after), "restarted": {
            unit: count - before[host].get(unit, 0) for unit, count in after.items()
            if count != before[host].get(unit, 0)}}
        for unit in UNITS:
            healthy, red, failing = runs(journal(ssh[host], unit, since))
            out["hosts"][host][unit] = {"healthy_runs": healthy, "red_runs": red,
                                        "red": failing[:5]}
    out["red_runs"] = sum(h[unit]["red_runs"] for h in out["hosts"].values() for unit in UNITS)
    out["restarted_units"] = sum(len(h["restarted"]) for h in out["hosts"].values())
    print(json.dumps(out, indent=1))
    return 1 if out["red_runs"] or out["restarted_units"] else 0


if __name__ == "__main__":
    sys.exit(main())

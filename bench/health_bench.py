#!/usr/bin/env python3
"""Health checker cost benchmark: CPU and wall time of one checker run on the machine it
runs on (a real GPU host, or a lab host with its simulated nvidia-smi), and of each tool
the run calls. Stdlib only, Python 3.8+, so it runs where the checker runs.

Every round runs the installed checker as its timer does (`healthcheck.py --config CFG`),
with a config of this host's GPU checks only (no units: no engine is needed), and takes
the CPU seconds of the run and everything it started (getrusage of the waited children:
nvidia-smi, journalctl). Then each tool alone, the same way. Medians and p90 over the
rounds; one JSON document on stdout (or --out).

    python3 bench/health_bench.py [--rounds 20] [--out FILE] [--label TEXT]
                                  [--ib-sysfs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKER = os.path.join(REPO, "gpufleet", "host", "healthcheck.py")
sys.path.insert(0, os.path.dirname(CHECKER))
from healthcheck import journal_from  # noqa: E402  (the checker's own way to read on)

TOOLS = {
    "nvidia-smi -q -x": ["nvidia-smi", "-q", "-x"],
    "nvidia-smi nvlink -s": ["nvidia-smi", "nvlink", "-s"],
    "nvidia-smi nvlink -e": ["nvidia-smi", "nvlink", "-e"],
}


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(argv):
    """(wall s, CPU s of the process and its waited children, exit code)."""
    cpu, wall = children_cpu(), time.monotonic()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    return time.monotonic() - wall, children_cpu() - cpu, proc.returncode


def summary(samples):
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"median": round(statistics.median(ordered), 4), "p90": round(p90, 4),
            "min": round(ordered[0], 4), "max": round(ordered[-1], 4)}


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--label", default=platform.node())
    parser.add_argument("--ib-sysfs", help="also check the HCAs under this sysfs folder")
    args = parser.parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        sys.exit("health_bench: nvidia-smi not found: run it on a GPU host or a lab host")
    gpus = gpu_count()
    work = tempfile.mkdtemp(prefix="health-bench-")
    shutil.copy(CHECKER, work)
    shutil.copy(os.path.join(REPO, "gpufleet", "module_utils", "gpu_facts.py"), work)
    cfg = {"version": 1, "host": args.label, "units": [],
           "textfile": os.path.join(work, "gpufleet.prom"),
           "state_file": os.path.join(work, "state.json"),
           "gpu": {"vendor": "nvidia", "count": gpus}}
    if args.ib_sysfs:
        cfg["ib"] = {"sysfs": args.ib_sysfs}
    config = os.path.join(work, "health.json")
    with open(config, "w", encoding="utf-8") as handle:
        json.dump(cfg, handle)
    checker = [sys.executable, "-I", "-S", os.path.join(work, "healthcheck.py"),
               "--config", config]
    first = subprocess.run(checker + ["--json"], capture_output=True, text=True)
    report = json.loads(first.stdout) if first.stdout.strip().startswith("{") else {}
    runs = [measure(checker) for _ in range(args.rounds)]
    tools = dict(TOOLS)
    if shutil.which("journalctl"):  # what the Xid check runs, after the cursor it keeps
        with open(cfg["state_file"], encoding="utf-8") as handle:
            cursor = json.load(handle).get("gpu", {}).get("journal_cursor")
        tools["journalctl -k (from cursor)"] = [
            "journalctl", "-k", "-o", "json", "--output-fields=MESSAGE", "--no-pager", "-q"] + (
            [journal_from(cursor)] if cursor else [])
    for name, argv_ in tools.items():
        got = [measure(argv_) for _ in range(args.rounds)]
        tools[name] = {"cpu_ms": summary([c * 1000 for _, c, _ in got]),
                       "wall_ms": summary([w * 1000 for w, _, _ in got]),
                       "exit": sorted({rc for _, _, rc in got})}
    out = {
        "label": args.label, "gpus": gpus, "rounds": args.rounds,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "checker": {"cpu_ms": summary([c * 1000 for _, c, _ in runs]),
                    "wall_ms": summary([w * 1000 for w, _, _ in runs]),
                    "exit": sorted({rc for _, _, rc in runs})},
        "tools": tools,
        "checks": [{k: c[k] for k in ("check", "status", "detail")}
                   for c in report.get("checks", [])],
        "goal": "<= 50 ms CPU per run on an 8-GPU host (issue: fleet health)",
    }
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    print(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The health watcher (healthcheck.py --watch): how fast a host fault reaches the metrics,
and what one of its polls costs. Prints one JSON document.

    python3 bench/health_watch.py poll [--rounds 200]
        on a GPU host (real or lab): CPU and wall time of one watcher poll (NVML through
        ctypes where libnvidia-ml loads, else nvidia-smi -q -x), per poll and per GPU.

    python3 bench/health_watch.py latency --host lab1 [--rounds 5]
        on the lab's controller, with a deployment up: each fault injected below the
        interface the checker reads (the simulated GPU's nvidia-smi, the kernel journal, the
        HCAs' sysfs where the host's plan uses RDMA), the seconds until the host's metrics
        show it, then cleared; and the watcher's own CPU over an idle minute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTFILE = "/var/lib/prometheus/node-exporter/gpufleet.prom"
CHECKER = "/usr/bin/python3 -I -B /usr/local/lib/gpufleet/healthcheck.py"


def load_checker():
    """The installed checker where there is one, else the repository's."""
    for where in ("/usr/local/lib/gpufleet", os.path.join(ROOT, "gpufleet", "host")):
        if os.path.exists(os.path.join(where, "healthcheck.py")):
            sys.path.insert(0, where)
            if where.endswith("host"):
                sys.path.insert(0, ROOT)
            import healthcheck
            return healthcheck
    raise SystemExit("healthcheck.py not found")


def cpu():
    self_, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                   resource.RUSAGE_CHILDREN))
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


def poll(args):
    hc = load_checker()
    nvml = hc.Nvml.open()
    if nvml:
        read, backend = nvml.signature, "nvml"
    else:
        read, backend = (lambda: hc.smi_signature(30)), "nvidia-smi -q -x"
    gpus = len(read()) - 1 if nvml else len(read())
    cpu_ms, wall_ms = [], []
    for _ in range(args.rounds):
        c, w = cpu(), time.perf_counter()
        read()
        cpu_ms.append((cpu() - c) * 1000)
        wall_ms.append((time.perf_counter() - w) * 1000)
    med = statistics.median(cpu_ms)
    print(json.dumps({"what": "one watcher poll", "backend": backend, "gpus": gpus,
                      "rounds": args.rounds, "cpu_ms_median": round(med, 3),
                      "cpu_ms_p90": round(sorted(cpu_ms)[int(0.9 * len(cpu_ms))], 3),
                      "wall_ms_median": round(statistics.median(wall_ms), 3),
                      "cpu_ms_per_gpu": round(med / max(gpus, 1), 3)}, indent=1))


def lab_ssh(host):
    sys.path.insert(0, os.path.join(ROOT, "lab"))
    from gpufleet_lab import hosts

    def ssh(command, check=True):
        proc = subprocess.run(hosts.ssh_cmd(host, command), capture_output=True, text=True,
                              timeout=120)
        if check and proc.returncode != 0:
            raise SystemExit(f"{host}: {command}: {proc.stderr.strip()}")
        return proc.stdout
    return hosts, ssh


def latency(args):
    hosts, ssh = lab_ssh(args.host)
    pid = ssh("systemctl show -p MainPID --value gpufleet-health-watch.service").strip()
    if pid in ("", "0"):
        raise SystemExit(f"gpufleet-health-watch is not running on {args.host}: deploy first")
    cfg = json.loads(ssh("grep -v '^#' /etc/gpufleet/health.json"))
    pci = re.search(r'<gpu id="0000(\w{4}:\w\w:\w\w)\.0">', ssh("nvidia-smi -q -x")).group(1)
    faults_file = "/var/lib/gpufleet-lab/gpu-faults.json"

    def gpu_fault(tags):
        return lambda: ssh(f"echo '{json.dumps({'xml': {'1': tags}})}' > {faults_file}")

    def ok(check):
        found = re.search(rf'^gpufleet_health_check_ok{{check="{check}",unit=""}} (\S+)$',
                          ssh(f"cat {TEXTFILE}"), re.M)
        return found.group(1) if found else None

    def green():  # the fault gone (the Xid cleared after the "reset"); one timer run
        # a GPU reset leaves the kernel log as it is: the injected Xids stay in the journal
        # until the end (removing the file that holds the checker's cursor would leave the
        # cursor nowhere, which only a reboot does, and a reboot also resets the checker)
        ssh(f"rm -f {faults_file}; {CHECKER} --clear-xid all >/dev/null || true")
        for sysfs_state in ib_states:
            ssh(f"echo '4: ACTIVE' > {sysfs_state}")
        ssh("systemctl start gpufleet-health.service", check=False)
        # a poll must see the healthy state, or the next fault is no change to it
        time.sleep(2 * (cfg.get("watch", {}).get("interval_s") or 2))

    cases = {
        "fabric status": ("gpu_fabric", gpu_fault({"status": "Insufficient Resources"})),
        "uncorrectable ECC": ("gpu_ecc", gpu_fault({"dram_uncorrectable": "2"})),
        "fatal Xid 79": ("gpu_xid", lambda: hosts.kernel_message(
            args.host, f"NVRM: Xid (PCI:{pci}): 79, pid=0, GPU has fallen off the bus.")),
    }
    ib_states = []
    if cfg.get("ib"):
        port = ssh(f"ls -d {cfg['ib']['sysfs']}/*/ports/1 | head -1").strip()
        ib_states.append(port + "/state")
        cases["HCA port down"] = ("ib", lambda: ssh(f"echo '1: DOWN' > {port}/state"))
    out = {"host": args.host, "interval_s": cfg.get("watch", {}).get("interval_s"),
           "rounds": args.rounds, "faults": {}}
    green()
    for name, (check, inject) in cases.items():
        took = []
        for _ in range(args.rounds):
            deadline = time.monotonic() + 30
            while ok(check) != "1" and time.monotonic() < deadline:
                time.sleep(0.2)
            started = time.monotonic()
            inject()
            while ok(check) != "0" and time.monotonic() - started < 30:
                time.sleep(0.05)
            took.append(round(time.monotonic() - started, 2))
            green()
        out["faults"][name] = {"check": check, "seconds": took,
                               "median_s": statistics.median(took), "max_s": max(took)}
    hosts.clear_kernel_messages(args.host)  # as a reboot would, for whatever runs next

    def watcher_cpu():  # the watcher and the checks it ran (its waited children)
        fields = ssh(f"cat /proc/{pid}/stat").rsplit(")", 1)[1].split()
        return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    before, start = watcher_cpu(), time.monotonic()
    time.sleep(args.idle_s)
    spent = watcher_cpu() - before
    polls = (time.monotonic() - start) / (out["interval_s"] or 2)
    out["idle"] = {"seconds": args.idle_s, "cpu_s": round(spent, 3),
                   "cpu_ms_per_poll": round(spent * 1000 / polls, 2),
                   "cpu_share_of_one_core": round(spent / args.idle_s, 4)}
    print(json.dumps(out, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("poll")
    p.add_argument("--rounds", type=int, default=200)
    p = sub.add_parser("latency")
    p.add_argument("--host", default="lab1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle-s", type=int, default=60)
    args = parser.parse_args()
    (poll if args.mode == "poll" else latency)(args)


if __name__ == "__main__":
    main()

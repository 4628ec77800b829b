#!/usr/bin/env python3
"""Converge benchmark on the lab: how site.yml's time grows with hosts, what the
project's ansible.cfg buys over Ansible's defaults, deploy overhead, change cost and
the fleet health sweep. Every figure comes from one run on this machine; the goals
are ratios within that run, since the machine is noisy.

For each size N (default 1, 4, 8, 16) the lab is rebuilt with N fresh hosts and the
target (default h200-pd-1node) is deployed as replicas, one copy per host:

- first deploy: site.yml up to the passing smoke test and the health timer, with
  Ansible's per-task timings; the engines' own start time (the serve role's
  readiness waits) is subtracted to give gpufleet's overhead
- no-op re-run with the project's ansible.cfg, and (at --defaults-at sizes) with
  Ansible's defaults: forks 5, no pipelining, no SSH multiplexing, no fact cache
- no-op re-run with Mitogen's strategy plugin (at --mitogen-at sizes), the option
  the issue asks to weigh; installed from PyPI into .cache/mitogen, never used by fab
- change cost: one flag changed on decode; units restarted and wall time
- fleet health: `fab health` over all hosts
- `fab deploy` as a user runs it, a no-op: wall, and the CPU of fab and everything it
  starts (ansible-playbook, its workers, the SSH clients and their shared masters),
  counted by a cpuacct cgroup the command starts in; with `fab plan`'s own cost (its
  start, imports and planning) at each size, and a profile of it at the largest
- the planner alone on placeholder inventories of 16, 100 and 1,000 hosts (no lab)

From the `fab deploy` no-op at each size, a least-squares line (fixed + per host) gives
the projection to 100 and 1,000 hosts. `--noop-only` skips the change, health, defaults
and Mitogen runs (the first deploy of each size still comes first).

Each no-op run also records CPU seconds: the controller's (ansible-playbook, its
workers and ssh clients) and the whole machine's; on this machine the lab hosts share
the controller's cores, so what grows with N is told apart from what would run on the
hosts' own CPUs in a real fleet.

    python bench/converge.py [--sizes 1,4,8,16] [--defaults-at 1,4]
                             [--mitogen-at 1,16] [--noop-only]
                             [--out bench/results/converge.json]

Needs root (the lab). Leaves the lab up with the largest size.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lab"))  # the lab's package, gpufleet_lab (not installed)
BIN = Path(sys.executable).parent
TARGET = "h200-pd-1node"
CHANGE = {"decode": {"--max-num-seqs": 256}}
MITOGEN = "mitogen==0.3.54"
# the serve role's readiness waits: the engines' and routers' own start time
WAIT_TASK = re.compile(r"Serve \| (Ready|Service \| Wait until ready)")


def log(msg: str) -> None:
    print(f"[converge] {msg}", file=sys.stderr, flush=True)


def machine_cpu_s() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def controller_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


LAST_CPU: dict[str, float] = {}
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def in_cgroup(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Run CMD (checked) in a cgroup of its own: (wall s, CPU s of it and everything it
    started, daemonized SSH masters included, output). Without cgroup v1's cpuacct, the
    CPU of the children waited for (RUSAGE_CHILDREN), which misses the SSH masters."""
    group = CPUACCT / f"gpufleet-bench-{os.getpid()}"
    if CPUACCT.is_dir():
        group.mkdir(exist_ok=True)
        (group / "cpuacct.usage").write_text("0")

    def enter() -> None:
        if group.is_dir():
            (group / "cgroup.procs").write_text(str(os.getpid()))

    t0, c0 = time.monotonic(), controller_cpu_s()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "NO_COLOR": "1", **(env or {})},
                          capture_output=True, text=True, check=False, preexec_fn=enter)
    took = time.monotonic() - t0
    if group.is_dir():
        cpu = int((group / "cpuacct.usage").read_text()) / 1e9
        for pid in (group / "cgroup.procs").read_text().split():  # SSH masters: let go
            (CPUACCT / "cgroup.procs").write_text(pid)
        group.rmdir()
    else:
        cpu = controller_cpu_s() - c0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-2000:]}")
    return took, cpu, proc.stdout + proc.stderr


def fab_costs(inv: str, n: int, profile: bool) -> dict:
    """`fab deploy` as a no-op, and `fab plan` alone (start, imports, planning)."""
    # the SSH masters the runs before left (ControlPersist) would carry fab's SSH work
    # outside its cgroup: fab starts its own, as after a pause of two minutes
    subprocess.run(["pkill", "-f", r"^ssh: .*\[mux\]"], check=False)
    took, cpu, out = in_cgroup([str(BIN / "fab"), "deploy", "-i", inv])
    plan_s, plan_cpu, _ = in_cgroup([str(BIN / "fab"), "plan", "-i", inv, "--format", "json"])
    start_s, start_cpu, _ = in_cgroup([str(BIN / "fab"), "--list"])
    result = {"fab_noop_s": round(took, 1), "fab_noop_cpu_s": round(cpu, 1),
              "fab_noop_changed": changed(out),
              "fab_noop_tasks_per_host": max(v for h, v in tasks_per_host(out).items()
                                             if h != "localhost"),
              "fab_plan_s": round(plan_s, 2), "fab_plan_cpu_s": round(plan_cpu, 2),
              "fab_start_s": round(start_s, 2), "fab_start_cpu_s": round(start_cpu, 2)}
    log(f"{n}: fab deploy no-op {took:.1f}s, {cpu:.1f} CPU-s (fab and all it started); "
        f"fab plan {plan_s:.2f}s, fab's start {start_s:.2f}s")
    if profile:
        result["fab_plan_profile"] = profile_plan(inv)
    return result


def profile_plan(inv: str, top: int = 12) -> list[tuple[str, float]]:
    """Where `fab plan` spends its time: cProfile's cumulative seconds of the gpufleet and
    invoke functions and the imports, largest first."""
    import pstats

    with tempfile.NamedTemporaryFile(suffix=".prof") as prof:
        subprocess.run([str(BIN / "python"), "-m", "cProfile", "-o", prof.name,
                        str(BIN / "fab"), "plan", "-i", inv, "--format", "json"],
                       cwd=ROOT, capture_output=True, check=True)
        stats = pstats.Stats(prof.name).stats
    rows = []
    for (path, line, func), (_, _, _, cum, _) in stats.items():
        if "/gpufleet/" in path or func == "_find_and_load":  # all imports, nested
            rows.append((f"{Path(path).name}:{line}({func})", round(cum, 3)))
    return sorted(rows, key=lambda r: -r[1])[:top]


def plan_at_scale(sizes: tuple[int, ...] = (16, 100, 1000)) -> dict[str, float]:
    """The planner alone (make_plan in this process), one replica per placeholder host."""
    from gpufleet import inventory as inv_mod
    from gpufleet.plan import make_plan

    out = {}
    for n in sizes:
        inv = inv_mod.placeholder({"workers": n})
        t0 = time.process_time()
        make_plan(TARGET, inv, {"replicas": True})
        out[str(n)] = round(time.process_time() - t0, 3)
    log(f"planner alone, CPU s by hosts: {out}")
    return out


def projection(results: list[dict], key: str) -> dict:
    """Least squares over the sizes: fixed + per_host * hosts, and 100 and 1,000 hosts."""
    xs = [r["hosts"] for r in results]
    ys = [r[key] for r in results]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    fixed = my - slope * mx
    return {"fixed": round(fixed, 2), "per_host": round(slope, 3),
            "at_100": round(fixed + slope * 100, 1), "at_1000": round(fixed + slope * 1000, 1)}


def run(cmd: list[str], env: dict | None = None, check: bool = True) -> tuple[float, str]:
    t0, m0, c0 = time.monotonic(), machine_cpu_s(), controller_cpu_s()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, check=False)
    took = time.monotonic() - t0
    LAST_CPU.update(controller_cpu_s=round(controller_cpu_s() - c0, 1),
                    machine_cpu_s=round(machine_cpu_s() - m0, 1))
    if check and proc.returncode != 0:
        failures = re.findall(r"^(?:fatal|failed): .*?(?=^TASK|^PLAY|\Z)", proc.stdout, re.M | re.S)
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                 + ("\n".join(f[:2000] for f in failures) or proc.stdout[-3000:])
                 + f"\n{proc.stderr[-2000:]}")
    return took, proc.stdout + proc.stderr


def changed(output: str) -> int:
    return sum(int(n) for n in re.findall(r"^\S+\s+:\s+ok=\d+\s+changed=(\d+)", output, re.M))


def tasks_per_host(output: str) -> dict[str, int]:
    """Tasks each host ran or skipped, from the play recap (ok counts changed too)."""
    return {host: int(ok) + int(failed) + int(skipped) for host, ok, failed, skipped in
            re.findall(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=\d+\s+unreachable=\d+\s+"
                       r"failed=(\d+)\s+skipped=(\d+)", output, re.M)}


def task_times(output: str) -> list[tuple[str, float]]:
    """profile_tasks' summary: (task name, seconds)."""
    return [(name.strip(), float(sec)) for name, sec in
            re.findall(r"^(.+?) -{2,} (\d+\.\d+)s\s*$", output, re.M)]


def inventory(workdir: Path, n: int, args: dict | None = None) -> str:
    """The lab's inventory with every host in `workers` and one copy per host."""
    dst = workdir / f"lab-{n}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ROOT / "inventories" / "lab", dst)
    hosts = yaml.safe_load((dst / "hosts.yml").read_text())
    names = list(hosts["all"]["children"]["lab"]["hosts"])
    hosts["all"]["children"] = {"lab": hosts["all"]["children"]["lab"],
                                "workers": {"hosts": {h: {} for h in names}}}
    (dst / "hosts.yml").write_text(yaml.safe_dump(hosts))
    group_vars = yaml.safe_load((dst / "group_vars" / "all.yml").read_text())
    group_vars.update(gpufleet_target=TARGET, gpufleet_replicas=True)
    if args:
        group_vars["gpufleet_args"] = args
    (dst / "group_vars" / "all.yml").write_text(yaml.safe_dump(group_vars))
    return str(dst)


def defaults_cfg(workdir: Path) -> str:
    """ansible.cfg with Ansible's default performance settings (paths kept)."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "ansible.cfg")
    for key in ("forks", "gathering", "fact_caching", "fact_caching_connection",
                "fact_caching_timeout"):
        cfg.remove_option("defaults", key)
    cfg["ssh_connection"] = {"pipelining": "False", "ssh_args": "-o ControlMaster=no"}
    # the collection (the checkout, through collections/) from wherever this file is
    cfg["defaults"]["collections_path"] = str(ROOT / "collections")
    path = workdir / "ansible-defaults.cfg"
    with path.open("w") as fh:
        cfg.write(fh)
    return str(path)


def mitogen_env() -> dict:
    """Ansible settings for Mitogen's linear strategy (pip --target, not in .venv)."""
    target = ROOT / ".cache" / "mitogen"
    if not (target / "ansible_mitogen").is_dir():
        log(f"installing {MITOGEN} into {target}")
        run([str(BIN / "python"), "-m", "pip", "install", "--quiet", "--target", str(target),
             MITOGEN])
    # Mitogen's own ssh reads host_key_checking, not the lab's StrictHostKeyChecking=no
    # ssh argument: one of the behaviour differences weighed in docs/performance.md
    return {"ANSIBLE_STRATEGY_PLUGINS": str(target / "ansible_mitogen/plugins/strategy"),
            "ANSIBLE_STRATEGY": "mitogen_linear", "ANSIBLE_HOST_KEY_CHECKING": "False"}


def site(inv: str, cfg: str, profile: bool = False,
         extra: dict | None = None) -> tuple[float, str]:
    env = {"ANSIBLE_CONFIG": cfg, "NO_COLOR": "1", **(extra or {})}
    if profile:
        env["ANSIBLE_CALLBACKS_ENABLED"] = "ansible.posix.profile_tasks"
        env["PROFILE_TASKS_TASK_OUTPUT_LIMIT"] = "all"
    return run([str(BIN / "ansible-playbook"), "-i", inv, "site.yml"], env)


def main_pids(hosts: list[str]) -> dict[str, str]:
    from gpufleet_lab.hosts import ssh_cmd
    out = {}
    for h in hosts:
        proc = subprocess.run(ssh_cmd(h, "systemctl show -p Id,MainPID 'gpufleet-*.service'"),
                              capture_output=True, text=True, check=True)
        for block in proc.stdout.strip().split("\n\n"):
            fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            out[f"{h}/{fields['Id']}"] = fields["MainPID"]
    return out


def bench_size(n: int, workdir: Path, with_defaults: bool, with_mitogen: bool,
               first_only: bool = False, noop_only: bool = False,
               profile: bool = False) -> dict:
    log(f"lab with {n} host(s)")
    run([str(BIN / "fab"), "lab.up", "--hosts", str(n)])
    inv = inventory(workdir, n)
    ours = str(ROOT / "ansible.cfg")
    first, out = site(inv, ours, profile=True)
    waits = sum(s for name, s in task_times(out) if WAIT_TASK.search(name))
    log(f"{n}: first deploy {first:.1f}s (readiness waits {waits:.1f}s)")
    slowest_first = sorted(task_times(out), key=lambda t: -t[1])[:5]
    if first_only:
        return {"hosts": n, "first_deploy_s": round(first, 1), "engine_start_s": round(waits, 1),
                "overhead_s": round(first - waits, 1), "slowest_tasks_first": slowest_first}
    noop, out = site(inv, ours, profile=True)
    result = {"hosts": n, "first_deploy_s": round(first, 1),
              "engine_start_s": round(waits, 1), "overhead_s": round(first - waits, 1),
              "noop_rerun_s": round(noop, 1), "noop_changed": changed(out),
              "noop_cpu": dict(LAST_CPU),
              "noop_controller_cpu_per_host_s": round(LAST_CPU["controller_cpu_s"] / n, 2),
              "noop_tasks_per_host": max(v for h, v in tasks_per_host(out).items()
                                         if h != "localhost"),
              "noop_tasks_controller": tasks_per_host(out).get("localhost", 0),
              "slowest_tasks_first": slowest_first,
              "slowest_tasks_noop": sorted(task_times(out), key=lambda t: -t[1])[:5]}
    log(f"{n}: no-op re-run {noop:.1f}s, changed={result['noop_changed']}, "
        f"{result['noop_tasks_per_host']} tasks per host, "
        f"{result['noop_controller_cpu_per_host_s']} controller CPU-s per host")
    result.update(fab_costs(inv, n, profile))
    if noop_only:
        return result
    if with_defaults:
        slow, out = site(inv, defaults_cfg(workdir), profile=True)  # as ours: same callback
        result.update(noop_rerun_defaults_s=round(slow, 1),
                      config_speedup=round(slow / noop, 2))
        log(f"{n}: no-op re-run with Ansible's defaults {slow:.1f}s")
    if with_mitogen:
        fast, out = site(inv, ours, profile=True, extra=mitogen_env())
        result.update(noop_rerun_mitogen_s=round(fast, 1), noop_changed_mitogen=changed(out),
                      noop_cpu_mitogen=dict(LAST_CPU))
        log(f"{n}: no-op re-run with Mitogen {fast:.1f}s, changed={changed(out)}")
    hosts = [f"lab{i}" for i in range(1, n + 1)]
    before = main_pids(hosts)
    took, _ = site(inventory(workdir, n, CHANGE), ours)
    after = main_pids(hosts)
    restarted = sorted(k for k in after if after[k] != before.get(k))
    expected = sorted(f"{h}/gpufleet-decode.service" for h in hosts)
    result.update(change_s=round(took, 1), change_restarted=restarted,
                  change_restarted_exactly_affected=restarted == expected)
    log(f"{n}: one-flag change {took:.1f}s, restarted {len(restarted)} unit(s)")
    health, _ = run([str(BIN / "fab"), "health", "-i", inventory(workdir, n, CHANGE)])
    result["fleet_health_s"] = round(health, 2)
    log(f"{n}: fab health {health:.2f}s")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4,8,16")
    p.add_argument("--defaults-at", default="1,4", help="sizes that also run the defaults")
    p.add_argument("--mitogen-at", default="1,16", help="sizes that also run Mitogen")
    p.add_argument("--first-only", action="store_true",
                   help="only the first deploy of each size; prints JSON, writes nothing")
    p.add_argument("--noop-only", action="store_true",
                   help="after each first deploy, only the no-ops (Ansible's and fab's)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "converge.json"))
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    with_defaults = {int(x) for x in args.defaults_at.split(",") if x and not args.noop_only}
    with_mitogen = {int(x) for x in args.mitogen_at.split(",") if x and not args.noop_only}
    results = []
    partial = Path(args.out).with_suffix(".partial.json")
    if args.first_only:
        with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
            print(json.dumps([bench_size(n, Path(tmp), False, False, first_only=True)
                              for n in sizes], indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        for n in sizes:
            results.append(bench_size(n, Path(tmp), n in with_defaults, n in with_mitogen,
                                      noop_only=args.noop_only, profile=n == max(sizes)))
            partial.write_text(json.dumps(results, indent=2) + "\n")  # kept if a size fails
    partial.unlink()
    base, top = results[0], results[-1]
    summary = {
        "machine": f"{os.cpu_count()} cores, {os.uname().release}",
        "target": TARGET, "sizes": results,
        "noop_scaling": round(top["noop_rerun_s"] / base["noop_rerun_s"], 2),
        "noop_controller_cpu_scaling": round(top["noop_cpu"]["controller_cpu_s"]
                                             / base["noop_cpu"]["controller_cpu_s"], 2),
        "goal_noop_scaling_max": 2.0,
        # marginal controller CPU of one more host: (top - base) / (hosts added)
        "noop_controller_cpu_per_added_host_s": round(
            (top["noop_cpu"]["controller_cpu_s"] - base["noop_cpu"]["controller_cpu_s"])
            / max(1, top["hosts"] - base["hosts"]), 2),
        "goal_noop_controller_cpu_per_host_max_s": 1.0,
        "goal_noop_one_host_max_s": 10.0,
        "goal_noop_tasks_per_host_max": 60,
        "goal_config_speedup_min": 2.0,
        "goal_overhead_max_s": 120,
        "goal_fleet_health_max_s": 3.0,
        # fab deploy, a no-op, as a user runs it: fab and everything it starts
        "fab_noop_wall_projection_s": projection(results, "fab_noop_s"),
        "fab_noop_cpu_projection_s": projection(results, "fab_noop_cpu_s"),
        "fab_noop_cpu_per_added_host_s": round(
            (top["fab_noop_cpu_s"] - base["fab_noop_cpu_s"]) / max(1, top["hosts"] - base["hosts"]),
            2),
        "goal_fab_noop_one_host_max_s": 10.0,
        "planner_alone_cpu_s": plan_at_scale(),
    }
    print(f"{'hosts':>5} {'first':>8} {'fab no-op':>9} {'fab CPU':>8} {'tasks/host':>10} "
          f"{'fab plan':>8} {'fab start':>9}")
    for r in results:
        print(f"{r['hosts']:>5} {r['first_deploy_s']:>7.1f}s {r['fab_noop_s']:>8.1f}s "
              f"{r['fab_noop_cpu_s']:>7.1f}s {r['fab_noop_tasks_per_host']:>10} "
              f"{r['fab_plan_s']:>7.2f}s {r['fab_start_s']:>8.2f}s")
    wall, cpu = summary["fab_noop_wall_projection_s"], summary["fab_noop_cpu_projection_s"]
    print(f"fab deploy no-op: {cpu['per_host']} CPU-s per added host (goal <= 1.0), "
          f"{base['fab_noop_s']} s at {base['hosts']} host(s) (goal <= 10)")
    print(f"projected: wall {wall['at_100']} s at 100 hosts, {wall['at_1000']} s at 1,000; "
          f"CPU {cpu['at_100']} s at 100, {cpu['at_1000']} s at 1,000")
    print(f"the planner alone, CPU s by hosts: {summary['planner_alone_cpu_s']}")
    if top.get("fab_plan_profile"):
        print(f"fab plan at {top['hosts']} hosts, cumulative s:")
        for name, sec in top["fab_plan_profile"]:
            print(f"  {sec:>7.3f}  {name}")
    if args.noop_only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}")
        return 0
    nan = float("nan")
    print(f"{'hosts':>5} {'first':>8} {'engines':>8} {'overhead':>8} {'no-op':>7} "
          f"{'cpu ctl/all':>12} {'defaults':>8} {'speedup':>7} {'mitogen':>7} "
          f"{'change':>7} {'restarts':>8} {'health':>7}")
    for r in results:
        cpu = r["noop_cpu"]
        print(f"{r['hosts']:>5} {r['first_deploy_s']:>7.1f}s {r['engine_start_s']:>7.1f}s "
              f"{r['overhead_s']:>7.1f}s {r['noop_rerun_s']:>6.1f}s "
              f"{cpu['controller_cpu_s']:>5.0f}/{cpu['machine_cpu_s']:<5.0f}s "
              f"{r.get('noop_rerun_defaults_s', nan):>7.1f}s "
              f"{r.get('config_speedup', nan):>6.2f}x "
              f"{r.get('noop_rerun_mitogen_s', nan):>6.1f}s {r['change_s']:>6.1f}s "
              f"{len(r['change_restarted']):>8} {r['fleet_health_s']:>6.2f}s")
    for r in results:
        print(f"{r['hosts']} host(s): {r['noop_tasks_per_host']} tasks per host on a no-op "
              f"(goal <= 60), {r['noop_controller_cpu_per_host_s']} controller CPU-s per host "
              f"(goal <= 1.0)")
    print(f"controller CPU per added host: {summary['noop_controller_cpu_per_added_host_s']} s")
    print(f"no-op re-run, {top['hosts']} hosts vs {base['hosts']}: "
          f"{summary['noop_scaling']}x (goal <= 2x); controller CPU "
          f"{summary['noop_controller_cpu_scaling']}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

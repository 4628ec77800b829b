#!/usr/bin/env python3
"""GPU acceptance on one host: do the GPUs and the links between them deliver?

    acceptance.py run --spec SPEC.json [--json]

The spec (written by the acceptance playbook from the plan) names the engine
environment's Python (it has PyTorch and its NCCL/RCCL), the GPU groups the plan gives
each engine, the sizes to measure and the hardware profile's expectations:

    {"host": "node1", "python": "/opt/gpufleet/venvs/vllm/bin/python",
     "groups": [{"name": "decode", "gpus": [0, 1]}], "gpus": [0, 1],
     "sizes_mib": [16, 128, 512, 1024], "threshold": 0.8, "timeout_s": 300,
     "expect": {"busbw_gbs": {"1024": 329}, "tflops_bf16": 600, "mem_write_gbs": 3500},
     "mem_fraction": 0.5, "env": {"NCCL_NVLS_ENABLE": "0"}}

Checks, each with measured, expected, ratio and verdict:
- nccl: an all_reduce (bf16) across each group's GPUs, one process per GPU as the engine
  runs them; bus bandwidth per size (nccl-tests' definition: algbw x 2(n-1)/n) and the
  sum checked; a collective that does not finish within timeout_s is a hung collective.
- gpu: per GPU, a memory pass (mem_fraction of the free memory written with four
  patterns and read back; the write rate measured) and a bf16 matmul (TFLOPS; a slice
  checked against float32).
Each rate is the best of three timed trials: a slow link or GPU is slow in every trial,
a moment of noise on the host in one.
- dcgm: `dcgmi diag -r 1` where DCGM is installed.
A failure names the GPUs and what the host says about them (inactive NVLink links, the
GPU fabric's state, the PCIe link below its maximum). Exit 0: every check passed; 1: a
check failed; 2: the spec or the environment is unusable. Runs on Python 3.8+; the
measuring processes need the engine environment's PyTorch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

GB = 1e9
MIB = 1 << 20
TRIALS = 3  # each figure is the best of this many timed trials


def log(msg):
    print(f"acceptance: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- measuring
# These run in the engine environment's Python (PyTorch); one process per GPU.


def nccl_rank(a):
    """One rank of the all_reduce; rank 0 prints the results as JSON lines."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(a.device)
    dist.init_process_group("nccl", init_method=f"tcp://{a.addr}:{a.port}", rank=a.rank,
                            world_size=a.world, timeout=datetime.timedelta(seconds=a.timeout))
    for mib in a.sizes:
        x = torch.empty(mib * MIB // 2, dtype=torch.bfloat16, device="cuda")
        x.fill_(1.0)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        correct = x[0].item() == a.world and x[-1].item() == a.world
        x.zero_()
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = max(5, min(500, 8192 // max(mib, 1)))  # 8 GiB a trial: ~25 ms on H200
        secs = float("inf")
        for _ in range(TRIALS):  # the best trial: a link is slow in every one, noise in one
            dist.barrier(device_ids=[a.device])
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            secs = min(secs, (time.perf_counter() - start) / iters)
        if a.report:  # the first rank of each host
            algbw = mib * MIB / secs / GB
            print(json.dumps({"size_mib": mib, "time_us": round(secs * 1e6, 1),
                              "algbw_gbs": round(algbw, 1),
                              "busbw_gbs": round(algbw * 2 * (a.world - 1) / a.world, 1),
                              "correct": correct}), flush=True)
        del x
    dist.destroy_process_group()
    return 0


def gpu_check(a):
    """Memory pass and matmul on one GPU; prints one JSON object."""
    import torch

    torch.cuda.set_device(a.device)
    free, total = torch.cuda.mem_get_info()
    n = int(free * a.mem_fraction) // 4 // MIB * MIB
    x = torch.empty(n, dtype=torch.int32, device="cuda")
    bad, secs = 0, float("inf")
    # 0101.., 1010.., 00001111.., 11110000..; the first write also maps the pages: not timed
    patterns = (0x55555555, -0x55555556, 0x0F0F0F0F, -0x0F0F0F10)
    for i, pattern in enumerate(patterns):
        torch.cuda.synchronize()
        start = time.perf_counter()
        x.fill_(pattern)
        torch.cuda.synchronize()
        secs = min(secs, time.perf_counter() - start) if i else secs
        for chunk in x.split(256 * MIB):
            bad += int((chunk != pattern).sum().item())
    del x
    torch.cuda.empty_cache()
    size = 8192
    gen = torch.Generator(device="cuda").manual_seed(1234)
    m1 = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
    m2 = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
    for _ in range(3):
        out = m1 @ m2
    torch.cuda.synchronize()
    iters, mm_secs = 30, float("inf")  # ~40 ms a trial on H200
    for _ in range(TRIALS):
        start = time.perf_counter()
        for _ in range(iters):
            out = m1 @ m2
        torch.cuda.synchronize()
        mm_secs = min(mm_secs, (time.perf_counter() - start) / iters)
    ref = m1[:32].float() @ m2[:, :32].float()
    err = float(((out[:32, :32].float() - ref).abs().max() / ref.abs().max()).item())
    print(json.dumps({
        "device": a.device, "name": torch.cuda.get_device_name(a.device),
        "memory_total_gib": round(total / 2**30, 1), "memory_tested_gib": round(n * 4 / 2**30, 1),
        "memory_errors": bad, "mem_write_gbs": round(n * 4 / secs / GB, 1),
        "tflops_bf16": round(2 * size**3 / mm_secs / 1e12, 1),
        "matmul_ok": bool(torch.isfinite(out).all().item()) and err < 0.02,
        "matmul_rel_err": round(err, 5)}), flush=True)
    return 0


# --------------------------------------------------------------------------- what the host says


def host_evidence(gpus):
    """Per GPU index: what nvidia-smi says that explains a slow or hung link."""
    found = {}
    nvsmi = shutil.which("nvidia-smi")
    if not nvsmi:
        return found
    try:
        status = subprocess.run([nvsmi, "nvlink", "-s"], capture_output=True, text=True,
                                timeout=30).stdout
        xml = subprocess.run([nvsmi, "-q", "-x"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return found
    index, down = None, {}
    for line in status.splitlines():
        head = re.match(r"GPU (\d+):", line)
        link = re.match(r"\s*Link (\d+): <inactive>", line)
        if head:
            index = int(head.group(1))
        elif index in gpus and link:
            down.setdefault(index, []).append(link.group(1))
    for index, links in down.items():
        found.setdefault(index, []).append(f"NVLink links {','.join(links)} inactive "
                                           "(nvidia-smi nvlink -s)")
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return found
    for i, gpu in enumerate(root.findall("gpu")):
        if i not in gpus:
            continue
        gen = gpu.findtext("pci/pci_gpu_link_info/pcie_gen/current_link_gen")
        gmax = gpu.findtext("pci/pci_gpu_link_info/pcie_gen/max_link_gen")
        width = gpu.findtext("pci/pci_gpu_link_info/link_widths/current_link_width")
        wmax = gpu.findtext("pci/pci_gpu_link_info/link_widths/max_link_width")
        if gen and gmax and gen != gmax or width and wmax and width != wmax:
            found.setdefault(i, []).append(f"PCIe gen {gen} {width} (max gen {gmax} {wmax})")
        state = gpu.findtext("fabric/state")
        status_ = gpu.findtext("fabric/status")
        if state and state not in ("Completed", "N/A") or status_ and status_ not in (
                "Success", "N/A"):
            found.setdefault(i, []).append(f"GPU fabric {state}/{status_}")
    return found


def cause(gpus, evidence, hung=False):
    said = [f"GPU {g}: {', '.join(evidence[g])}" for g in gpus if g in evidence]
    if said:
        return "; ".join(said)
    if hung:
        return ("no link reported down: check the fabric manager (systemctl status "
                "nvidia-fabricmanager) and NCCL_P2P_DISABLE / NCCL_IB_* in the environment")
    return ("no link reported down: a downtrained or shared link, another process on the "
            "GPUs, or clocks held low (nvidia-smi -q -d PERFORMANCE)")


# --------------------------------------------------------------------------- running


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(spec):
    """The environment of the engine environment's processes: ours plus the spec's."""
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    return env


def spawn(spec, args):
    return subprocess.Popen([spec["python"], os.path.abspath(__file__), *args],
                            env=child_env(spec),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(procs, timeout):
    """Wait for all; (hung, [(rc, out, err)]): a process past the deadline kills them all."""
    deadline = time.monotonic() + timeout
    results, hung = [], False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            for other in procs:
                with contextlib.suppress(OSError):
                    os.killpg(other.pid, signal.SIGKILL)
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    return hung, results


def last_error(results):
    for rc, _out, err in results:
        if rc:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            return lines[-1] if lines else f"exit {rc}"
    return ""


def verdict(measured, expected, threshold):
    if expected is None or measured is None:
        return None, "measured"
    ratio = round(measured / expected, 3) if expected else None
    return ratio, "pass" if ratio is not None and ratio >= threshold else "FAIL"


def busbw_expected(spec):
    """The profile's all_reduce bus bandwidth by message size (MiB) from the spec's JSON."""
    return {int(k): v for k, v in (spec.get("expect", {}).get("busbw_gbs") or {}).items()}


def check_group(spec, group, evidence):
    """The all_reduce across one engine's GPUs on this host."""
    expect = busbw_expected(spec)
    return collective(spec, "nccl", group["name"], group["gpus"], 0, len(group["gpus"]),
                      "127.0.0.1", free_port(), expect, lambda: cause(
                          group["gpus"], evidence()), lambda: cause(
                          group["gpus"], evidence(), hung=True))


def collective(spec, kind, name, gpus, first, world, addr, port, expect, why, why_hung):
    """Run the all_reduce ranks first.. of world on these GPUs; the figures as checks."""
    sizes, timeout = spec.get("sizes_mib", [16, 128, 512, 1024]), spec.get("timeout_s", 300)
    log(f"all_reduce {name} across GPUs {','.join(map(str, gpus))}"
        + (f" as ranks {first}-{first + len(gpus) - 1} of {world}" if world > len(gpus)
           else "") + f", {len(sizes)} sizes up to {max(sizes)} MiB")
    procs = [spawn(spec, ["nccl-rank", "--rank", str(first + r), "--world", str(world),
                          "--device", str(g), "--addr", addr, "--port", str(port),
                          "--timeout", str(timeout), "--sizes", *map(str, sizes)]
                   + (["--report"] if r == 0 else []))
             for r, g in enumerate(gpus)]
    hung, results = finish(procs, timeout)
    rows = [json.loads(ln) for ln in results[0][1].splitlines() if ln.startswith("{")]
    base = {"kind": kind, "name": name, "gpus": gpus}
    if hung:
        return [{**base, "verdict": "FAIL", "size_mib": None,
                 "detail": f"hung collective: the all_reduce {name} across GPUs "
                           f"{','.join(map(str, gpus))} did not finish in {timeout} s "
                           f"({why_hung()})"}]
    if any(rc for rc, _o, _e in results) or len(rows) != len(sizes):
        return [{**base, "verdict": "FAIL", "size_mib": None,
                 "detail": f"the all_reduce failed: {last_error(results) or 'no result'}"}]
    checks = []
    for row in rows:
        ratio, result = verdict(row["busbw_gbs"], expect.get(row["size_mib"]),
                                spec.get("threshold", 0.8))
        detail = ""
        if not row["correct"]:
            result, detail = "FAIL", "the all_reduce returned a wrong sum"
        elif result == "FAIL":
            detail = f"bus bandwidth {ratio:.0%} of expected: {why()}"
        checks.append({**base, "size_mib": row["size_mib"], "measured": row["busbw_gbs"],
                       "expected": expect.get(row["size_mib"]), "unit": "GB/s",
                       "ratio": ratio, "verdict": result, "detail": detail})
    return checks


# NCCL all_reduce across hosts over InfiniBand: the share of the host's HCA line rate
# (all ports x their rate) it reaches per message size, as nccl-tests runs between two
# HGX nodes commonly report (derived, not measured here: no multi-node machine)
IB_EFFICIENCY = {16: 0.45, 128: 0.75, 512: 0.88, 1024: 0.92}


def hcas(sysfs):
    """[(name, active, rate Gb/s)] of the host's HCA ports from sysfs."""
    out = []
    try:
        names = sorted(os.listdir(sysfs))
    except OSError:
        return out
    for name in names:
        ports = os.path.join(sysfs, name, "ports")
        for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:
            state = _read(os.path.join(ports, port, "state"))
            rate = re.match(r"([\d.]+)", _read(os.path.join(ports, port, "rate")))
            out.append((f"{name} port {port}", "ACTIVE" in state,
                        float(rate.group(1)) if rate else 0.0))
    return out


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def check_hcas(spec):
    """Every HCA port up, at the rate of the fastest: a port down or trained at a lower
    rate halves what NCCL and the KV transfer get (NCCL splits a collective equally over
    its NICs, so the slowest one sets the pace)."""
    ports = hcas(spec.get("ib_sysfs", "/sys/class/infiniband"))
    if not ports:
        return [{"kind": "hca", "name": "HCAs", "gpus": [], "verdict": "FAIL",
                 "detail": f"no HCA in {spec.get('ib_sysfs')}: the plan moves data over "
                           "RDMA; check the HCAs and their driver (ibstat)"}]
    top = max(rate for _n, _a, rate in ports)
    checks = []
    for name, active, rate in ports:
        detail = ""
        if not active:
            detail = f"{name} is down: check its cable and the switch port (ibstat)"
        elif rate < top:
            detail = (f"{name} at {rate:g} Gb/s, the others at {top:g}: a link trained "
                      "down; reseat or replace the cable")
        checks.append({"kind": "hca", "name": name, "gpus": [], "measured": rate,
                       "expected": top, "unit": "Gb/s", "ratio": round(rate / top, 3) if
                       active else 0.0, "verdict": "FAIL" if detail else "pass",
                       "detail": detail})
    return checks


def check_fabric(spec, evidence):
    """The all_reduce across every GPU host of the plan (one process per GPU, as a
    multi-node engine runs), over the fabric the plan uses: InfiniBand against the
    HCAs' line rate, or an MNNVL domain against the NVLink figures."""
    fab = spec["fabric"]
    gpus, counts, rank = spec["gpus"], fab["gpus_per_host"], fab["node_rank"]
    if fab["over"] == "ib":
        ports = hcas(spec.get("ib_sysfs", "/sys/class/infiniband"))
        line = len(ports) * max([r for _n, _a, r in ports] or [0]) / 8  # GB/s
        nvlink = busbw_expected(spec)
        # the slower of the two paths a cross-host ring takes: NVLink inside, IB between
        expect = {mib: round(min(line * eff, nvlink.get(mib, line)), 1)
                  for mib, eff in IB_EFFICIENCY.items()}

        def why():
            bad = [c["detail"] for c in check_hcas(spec) if c["verdict"] == "FAIL"]
            return "; ".join(bad) or (
                "this host's HCAs are all up at full rate: see the other hosts' hca checks; "
                + cause(gpus, evidence()))
    else:
        expect = busbw_expected(spec)

        def why():
            return cause(gpus, evidence()) + " (or another tray of the domain)"
    hosts = ", ".join(fab["hosts"])
    return collective(spec, "fabric", f"over {fab['over'].upper()} ({hosts})", gpus,
                      sum(counts[:rank]), sum(counts), fab["master"], fab["port"], expect,
                      why, lambda: f"a host of {hosts} did not join or the fabric hung: "
                      "check that every host runs acceptance at once, the port "
                      f"{fab['port']} between them, " + (
                          "the HCAs (ibstat)" if fab["over"] == "ib" else "IMEX"))


def check_gpus(spec, evidence):
    gpus, expect = spec["gpus"], spec.get("expect", {})
    log(f"memory and matmul on GPUs {','.join(map(str, gpus))}")
    procs = [spawn(spec, ["gpu-check", "--device", str(g),
                          "--mem-fraction", str(spec.get("mem_fraction", 0.5))]) for g in gpus]
    hung, results = finish(procs, spec.get("timeout_s", 300))
    checks = []
    for g, (rc, out, err) in zip(gpus, results):
        base = {"kind": "gpu", "name": f"GPU {g}", "gpus": [g]}
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if hung or rc or not lines:
            why = "did not finish (hung)" if hung else (last_error([(rc or 1, out, err)]))
            checks.append({**base, "verdict": "FAIL", "detail": f"GPU {g}: {why}"})
            continue
        r = json.loads(lines[-1])
        for metric, unit in (("mem_write_gbs", "GB/s"), ("tflops_bf16", "TFLOPS")):
            ratio, result = verdict(r[metric], expect.get(metric), spec.get("threshold", 0.8))
            detail = f"{r['name']}, {r['memory_tested_gib']} of {r['memory_total_gib']} GiB tested"
            if metric == "mem_write_gbs" and r["memory_errors"]:
                result, detail = "FAIL", (f"{r['memory_errors']} words read back wrong in "
                                          f"{r['memory_tested_gib']} GiB: reset the GPU, "
                                          "replace it if it repeats")
            elif metric == "tflops_bf16" and not r["matmul_ok"]:
                result, detail = "FAIL", (f"matmul result wrong (relative error "
                                          f"{r['matmul_rel_err']}): reset the GPU")
            elif result == "FAIL":
                detail = f"{ratio:.0%} of expected: {cause([g], evidence())}"
            checks.append({**base, "metric": metric, "measured": r[metric],
                           "expected": expect.get(metric), "unit": unit, "ratio": ratio,
                           "verdict": result, "detail": detail})
    return checks


def check_dcgm():
    dcgmi = shutil.which("dcgmi")
    if not dcgmi:
        return []
    log("dcgmi diag -r 1")
    try:
        res = subprocess.run([dcgmi, "diag", "-r", "1"], capture_output=True, text=True,
                             timeout=600)
        ok, tail = res.returncode == 0, (res.stdout + res.stderr).strip().splitlines()[-3:]
    except (OSError, subprocess.SubprocessError) as exc:
        ok, tail = False, [str(exc)]
    return [{"kind": "dcgm", "name": "dcgmi diag -r 1", "gpus": [],
             "verdict": "pass" if ok else "FAIL", "detail": " / ".join(tail)}]


def torch_problems(spec):
    """PyTorch in the engine environment and the GPUs it sees: what stops every check."""
    probe = ("import json, torch; print(json.dumps([torch.__version__, "
             "torch.cuda.is_available() and torch.cuda.device_count()]))")
    try:
        res = subprocess.run([spec["python"], "-c", probe], capture_output=True, text=True,
                             env=child_env(spec), timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"{spec['python']}: {exc}"]
    if res.returncode:
        lines = res.stderr.strip().splitlines() or ["no output"]
        return [f"PyTorch does not load in the engine environment ({spec['python']}): "
                f"{lines[-1]}. Fix: fab prepare installs the engine environment"]
    version, count = json.loads(res.stdout.strip().splitlines()[-1])
    missing = [g for g in spec["gpus"] if g >= (count or 0)]
    if missing:
        return [f"PyTorch {version} sees {count or 0} GPUs; the plan uses GPU "
                f"{','.join(map(str, missing))}: check nvidia-smi and CUDA_VISIBLE_DEVICES"]
    return []


def run(spec):
    cached = {}

    def evidence():
        """What nvidia-smi says about this host's GPUs: read once, when a check fails."""
        if "all" not in cached:
            cached["all"] = host_evidence(set(spec["gpus"]))
        return cached["all"]

    checks = []
    for group in spec.get("groups", []):
        if len(group["gpus"]) > 1:
            checks += check_group(spec, group, evidence)
    if (spec.get("fabric") or {}).get("over") == "ib":
        checks += check_hcas(spec)
    if spec.get("fabric"):
        checks += check_fabric(spec, evidence)
    checks += check_gpus(spec, evidence)
    checks += check_dcgm()
    return {"host": spec.get("host") or socket.gethostname(), "threshold":
            spec.get("threshold", 0.8), "checks": checks,
            "passed": bool(checks) and all(c["verdict"] != "FAIL" for c in checks)}


def load_spec(path):
    with (sys.stdin if path == "-" else open(path)) as fh:
        spec = json.load(fh)
    problems = []
    if not shutil.which(spec.get("python") or ""):
        problems.append(f"python {spec.get('python')!r} is not an executable: the engine "
                        "environment is not installed (fab prepare)")
    if not spec.get("gpus"):
        problems.append("no GPUs to test: the plan gives this host none")
    for group in spec.get("groups", []):
        extra = set(group.get("gpus", [])) - set(spec.get("gpus", []))
        if extra:
            problems.append(f"group {group.get('name')}: GPUs {sorted(extra)} are not in gpus")
    return spec, problems


def text(report):
    lines = [f"{report['host']}: {'PASS' if report['passed'] else 'FAIL'}"]
    for c in report["checks"]:
        what = c["name"] + (f" {c['size_mib']} MiB" if c.get("size_mib") else "") + (
            f" {c['metric']}" if c.get("metric") else "")
        num = (f"{c['measured']} / {c['expected']} {c['unit']}" if c.get("measured") is not None
               else "")
        ratio = "" if c.get("ratio") is None else f"{c['ratio']:.0%}"
        lines.append(f"  {c['kind']:5} {what:28} {num:26} {ratio:>5} {c['verdict']:5} "
                     f"{c.get('detail', '')}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--spec", required=True, help="the spec file (- for stdin)")
    r.add_argument("--json", action="store_true")
    n = sub.add_parser("nccl-rank")
    for name in ("--rank", "--world", "--device", "--port", "--timeout"):
        n.add_argument(name, type=int, required=True)
    n.add_argument("--sizes", type=int, nargs="+", required=True)
    n.add_argument("--addr", default="127.0.0.1", help="where rank 0 listens")
    n.add_argument("--report", action="store_true", help="print the figures")
    g = sub.add_parser("gpu-check")
    g.add_argument("--device", type=int, required=True)
    g.add_argument("--mem-fraction", type=float, default=0.5)
    a = p.parse_args(argv)
    if a.cmd == "nccl-rank":
        return nccl_rank(a)
    if a.cmd == "gpu-check":
        return gpu_check(a)
    try:
        spec, problems = load_spec(a.spec)
    except (OSError, ValueError) as exc:
        problems = [f"cannot read the spec {a.spec}: {exc}"]
    problems = problems or torch_problems(spec)
    if problems:
        for problem in problems:
            log(problem)
        return 2
    report = run(spec)
    print(json.dumps(report, indent=1) if a.json else text(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

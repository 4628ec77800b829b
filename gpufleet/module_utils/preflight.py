"""Host facts against the plan's host requirements: what does not fit, and the fix.

Stdlib only and Python 3.8 compatible: it runs inside the preflight Ansible module
on the host as well as in tests. `check_host` takes one host's requirements (the
`hosts` entry of the plan) and its facts (`gpu_facts.gpu_facts`/`ib_facts` output,
CPU architecture, free space on the cache filesystem) and returns every problem at
once, so one report covers the whole fleet before anything changes. What host
preparation itself fixes (fabric manager version, IMEX, nvidia_peermem) is checked
by `check_prepared`, after the roles ran.
"""

from __future__ import annotations

import os
import re

# A GPU may report a little less memory than the catalog's figure (ECC, firmware).
MEMORY_TOLERANCE = 0.97


def version_tuple(text):
    return tuple(int(x) for x in re.findall(r"\d+", str(text or ""))[:4])


def _owner(proc, pid):
    """(command name, systemd unit or '') of a process."""
    try:
        with open(f"{proc}/{pid}/comm") as fh:
            comm = fh.read().strip()
        with open(f"{proc}/{pid}/cgroup") as fh:
            cgroup = fh.read()
    except OSError:
        return "?", ""
    units = re.findall(r"([\w@.:-]+\.service)", cgroup)
    return comm, units[-1] if units else ""


def listeners(proc="/proc"):
    """{port: [(pid, command, unit)]} for every TCP socket listening on this host."""
    inodes = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A":  # LISTEN
                inodes[f[9]] = int(f[1].rsplit(":", 1)[1], 16)
    out = {port: [] for port in inodes.values()}
    for pid in (p for p in os.listdir(proc) if p.isdigit()):
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{proc}/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = link[8:-1] if link.startswith("socket:[") else None
            if inode in inodes:
                entry = (int(pid), *_owner(proc, pid))
                if entry not in out[inodes[inode]]:
                    out[inodes[inode]].append(entry)
    return out


def _ports_taken(req, listening, ours_prefix="gpufleet-"):
    problems = []
    for port in req.get("ports") or []:
        owners = listening.get(port)
        # this deployment's own units hold their ports on a re-run: only the others count
        others = [o for o in owners or [] if not o[2].startswith(ours_prefix)]
        if owners is None or (owners and not others):
            continue
        who = ", ".join(f"{comm} (pid {pid}{', ' + unit if unit else ''})"
                        for pid, comm, unit in others) or "a process this check cannot see"
        problems.append(f"port {port} is already in use by {who}. Fix: stop it, or give the "
                        "process that needs the port another one (gpufleet_ports / --set)")
    return problems


def _cache_writable(req, probe):
    path = (req.get("cache") or {}).get("path")
    if not path or not probe:
        return []
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        return []
    if read_only or not os.access(probe, os.W_OK):
        why = "is on a read-only filesystem" if read_only else "is not writable by root"
        return [f"cache path {path} {why} ({probe}). Fix: mount the shared cache read-write "
                "or point gpufleet_cache_dir at a writable shared filesystem"]
    return []


def check_host(req, gpu, ib=None, cpu_arch=None, cache_free_gib=None, listening=None,
               cache_probe=None):
    """Problems (strings naming value and fix) for one host; [] when it fits."""
    problems = []
    if listening is not None:
        problems += _ports_taken(req, listening)
    problems += _cache_writable(req, cache_probe)
    if cpu_arch and req.get("cpu_arch") and cpu_arch != req["cpu_arch"]:
        problems.append(f"CPU is {cpu_arch} but the target needs {req['cpu_arch']} hosts. "
                        "Fix: use the target for this hardware")
    want = req.get("gpu")
    if want:
        problems += _check_gpu(want, gpu or {}, req)
    if req.get("rdma"):
        problems += _check_rdma(ib or {}, req)
    if req.get("fabric_manager") and (gpu or {}).get("fabric_problem"):
        # an NVSwitch fabric this host neither runs nor has up (gpu_facts.fabric_problem)
        problems.append(gpu["fabric_problem"])
    cache = req.get("cache") or {}
    need = cache.get("min_free_gib")
    if need is not None and cache_free_gib is not None and cache_free_gib < need:
        problems.append(
            f"cache filesystem {cache.get('path')} has {cache_free_gib:.1f} GiB free, the "
            f"checkpoint needs {need:.1f} GiB. Fix: free space or point gpufleet_cache_dir at "
            "a larger shared filesystem")
    return problems


def _check_gpu(want, gpu, req):
    if not gpu.get("present") or not gpu.get("count"):
        return ["no {} GPU found (nvidia-smi/amd-smi reported none). Fix: install the driver "
                "(prepare) or check that the GPUs are seated".format(want["product"])]
    problems = []
    model = str(gpu.get("model") or "")
    if want["product"].lower() not in model.lower():
        problems.append("GPUs are {}, the target needs {}. Fix: pick the target for {} or "
                        "other hosts".format(model, want["product"], model))
    needed = max(want.get("used") or [0]) + 1
    if gpu["count"] < needed:
        problems.append(
            f"{gpu['count']} GPU(s) visible, the plan uses GPU indices up to {needed - 1} "
            f"({needed} GPUs). Fix: check `nvidia-smi -L` for a missing GPU (reseat, XID "
            "errors) or use a smaller target")
    memory = gpu.get("memory_mib") or 0
    if memory < want["memory_mib"] * MEMORY_TOLERANCE:
        problems.append(f"GPU memory {memory} MiB, the target expects {want['memory_mib']} MiB "
                        f"per GPU. Fix: use hosts with {want['product']} GPUs")
    if want.get("vendor") == "nvidia":
        driver, floor = gpu.get("driver_version"), req.get("driver_floor")
        if floor and version_tuple(driver) < version_tuple(floor):
            problems.append(f"NVIDIA driver {driver} is older than {floor}. Fix: install the "
                            f"R{floor.split('.')[0]} branch (nvidia_driver role, "
                            "nvidia_driver_branch) and reboot")
    elif req.get("rocm_floor"):
        have = gpu.get("rocm_version")
        if version_tuple(have) < version_tuple(req["rocm_floor"]):
            problems.append(f"ROCm {have} is older than {req['rocm_floor']}. Fix: install ROCm "
                            f"{req['rocm_floor']} or newer (the rocm role)")
    return problems


def check_prepared(req, gpu, ib=None):
    """After preparation: what the roles set up must be in place."""
    problems = []
    driver = gpu.get("driver_version")
    fm = gpu.get("fabric_manager_version")
    if req.get("fabric_manager") and fm and driver and fm != driver:
        branch = driver.split(".")[0]
        problems.append(
            f"nvidia-fabricmanager {fm} does not match driver {driver} (CUDA fails with error "
            "802 while nvidia-smi looks fine). Fix: apt-get install "
            f"nvidia-fabricmanager-{branch}={driver}-1 && apt-mark hold "
            f"nvidia-fabricmanager-{branch}")
    state = gpu.get("imex") or {}
    if req.get("imex") and state.get("all_connected") is False:
        problems.append(f"IMEX peers are not all connected ({state.get('domain_state')}). Fix: "
                        "start nvidia-imex on every node of the NVLink domain with the same "
                        "nodes_config.cfg")
    if req.get("peermem") and not (ib or {}).get("peermem_loaded"):
        problems.append("nvidia_peermem is not loaded (GPUDirect RDMA). Fix: modprobe "
                        "nvidia_peermem; if it fails with 'disagrees about version of symbol "
                        "ib_register_peer_memory_client', rebuild it against the installed OFED")
    return problems


def _check_rdma(ib, req):
    if not ib.get("present"):
        return ["no InfiniBand/RoCE HCA found, the target moves KV cache or tensors between "
                "nodes over RDMA. Fix: install the HCA driver (rdma role) or use a single-node "
                "target"]
    problems = []
    if not ib.get("all_active"):
        down = [
            "{}/{}".format(h.get("name"), p.get("port"))
            for h in ib.get("hcas", []) for p in h.get("ports", [])
            if p.get("state") != "Active"
        ]
        problems.append("HCA port(s) not Active: {}. Fix: check cabling and the subnet "
                        "manager (ibstat)".format(", ".join(down or ["?"])))
    return problems

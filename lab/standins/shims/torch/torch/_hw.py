"""The lab host's simulated hardware, as the stand-in's GPU timeline uses it."""

import functools
import json
import math
import os
import time

ROOT = os.environ.get("GPUFLEET_LAB_ROOT", "/")
GB = 1e9
# all_reduce bus bandwidth as a share of one GPU's NVLink bandwidth (links x speed), per
# message size in MiB: a real 2x H200 pair (NV18, 478 GB/s): 223, 286, 319, 329 GB/s
EFFICIENCY = {16: 0.467, 128: 0.598, 512: 0.667, 1024: 0.688}


def _path(p):
    return os.path.join(ROOT, p.lstrip("/"))


def _json(p, default):
    try:
        with open(_path(p)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


@functools.cache  # one process, one measurement: read once
def hw():
    return _json("/etc/gpufleet-lab/hw.json", {})


@functools.cache
def faults():
    return _json("/var/lib/gpufleet-lab/gpu-faults.json", {})


def driver_loaded():
    try:
        with open(_path("/etc/gpufleet-lab/modules")) as f:
            return any(line.split()[:1] in (["nvidia"], ["amdgpu"]) for line in f)
    except OSError:
        return False


def visible():
    """Physical GPU indices in CUDA_VISIBLE_DEVICES order: the GPUs whose device node this
    process sees (a container sees the ones CDI gave it), with the driver loaded."""
    gpus = [g["index"] for g in hw().get("gpus", [])
            if os.path.exists(_path(f"/dev/nvidia{g['minor']}"))] if driver_loaded() else []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return gpus
    out = []
    for word in env.split(","):
        if not word.strip().isdigit() or int(word) >= len(gpus):
            break
        out.append(gpus[int(word)])
    return out


def gpu_figure(name, default):
    return float(hw().get("gpu", {}).get(name, default))


def link_share(physical):
    """The share of its NVLink links a GPU has up (1.0 without NVLink)."""
    links = int(hw().get("gpu", {}).get("nvlink_links", 0) or 0)
    if not links:
        return 1.0
    down = faults().get("nvlink_inactive", {}).get(str(physical), [])
    return max(0.0, (links - len(down)) / links)


# NCCL over InfiniBand between hosts: the share of a host's HCA line rate (ports x rate)
# an all_reduce reaches per message size; NCCL splits the data equally over the NICs, so
# the slowest active port sets every port's pace
IB_EFFICIENCY = {16: 0.45, 128: 0.75, 512: 0.88, 1024: 0.92}


def _curve(table, mib):
    sizes = sorted(table)
    lo = max([s for s in sizes if s <= mib] or sizes[:1])
    hi = min([s for s in sizes if s >= mib] or sizes[-1:])
    if lo == hi:
        return table[lo] * (mib / lo if mib < lo else 1.0)
    t = (math.log2(mib) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + t * (table[hi] - table[lo])


def ib_line_gbs():
    """GB/s NCCL can drive over this host's HCAs: active ports x the slowest one's rate."""
    base = _path("/etc/gpufleet-lab/sys/class/infiniband")
    rates = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        port = os.path.join(base, name, "ports", "1")
        try:
            with open(os.path.join(port, "state")) as f:
                active = "ACTIVE" in f.read()
            with open(os.path.join(port, "rate")) as f:
                rate = float(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if active:
            rates.append(rate)
    return len(rates) * min(rates) / 8 if rates else 0.0


def rank_info(physical):
    """What the other ranks need to know of this one to time a collective."""
    return {"host": hw().get("hostname", ""), "share": link_share(physical),
            "ib_gbs": ib_line_gbs(), "mnnvl": bool(hw().get("imex"))}


def busbw(nbytes, infos):
    """GB/s an all_reduce of nbytes reaches across these ranks (rank_info of each)."""
    spec = hw().get("gpu", {})
    speed = float(str(spec.get("nvlink_speed", "25 GB/s")).split()[0])
    per_gpu = int(spec.get("nvlink_links", 0) or 0) * speed or 25.0
    mib = max(nbytes / 2**20, 1)
    bw = per_gpu * _curve(EFFICIENCY, mib) * min(i["share"] for i in infos)
    if len({i["host"] for i in infos}) > 1 and not all(i["mnnvl"] for i in infos):
        bw = min(bw, min(i["ib_gbs"] for i in infos) * _curve(IB_EFFICIENCY, mib))
    return bw


class Timeline:
    """One process's GPU work queue: operations end in order, each after its time."""

    def __init__(self):
        self.free_at = 0.0

    def enqueue(self, seconds):
        start = max(time.monotonic(), self.free_at)
        self.free_at = start + seconds

    def wait(self):
        while True:
            left = self.free_at - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 3600))


TIMELINE = Timeline()

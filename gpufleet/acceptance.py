"""GPU acceptance (fab acceptance, the deploy's opt-in gate): what each host's run of
gpufleet/host/acceptance.py gets from the plan, and the report the operator reads.

Per host: an all_reduce across the GPUs of each engine the plan puts there, a memory and
matmul pass per GPU, `dcgmi diag -r 1` where DCGM is installed; measured against the
hardware profile's figures (catalog hardware `acceptance`, with their source).
"""

from __future__ import annotations

SIZES_MIB = [16, 128, 512, 1024]
FABRIC_PORT = 29517  # where the first host's rank 0 meets the others (acceptance_port)
# the engines' own NCCL/RCCL settings apply to the measurement (never a secret)
ENV_PREFIXES = ("NCCL_", "RCCL_", "CUDA_DEVICE_ORDER", "HIP_", "TORCH_NCCL_")


def host_spec(host: dict, threshold: float = 0.8, timeout_s: int = 300,
              mem_fraction: float = 0.5, only: list | None = None, hosts: list | None = None,
              port: int = FABRIC_PORT, ib_sysfs: str = "/sys/class/infiniband",
              env: dict | None = None) -> dict:
    """The acceptance program's spec for one host's slice of the plan (model.host_slices);
    `only`: measure these GPU indices alone (a GPU after its reset, say); `hosts`: every
    planned host's slice, for the all_reduce across hosts where the plan uses a fabric."""

    def keep(gpus):
        return [g for g in gpus if g in only] if only else list(gpus)

    engines = [p for p in host["processes"] if p["is_engine"] and p["gpus"]]
    image = host["engine"]["runtime"] == "image"
    engine_env = {k: v for p in engines[:1] for k, v in p["env"].items()
                  if k.startswith(ENV_PREFIXES)}
    expect = {k: v for k, v in (host.get("acceptance") or {}).items() if k != "source"}
    return {
        "host": host["name"],
        # the image's own Python inside its container; else the engine venv's
        "python": "python3" if image else f"{host['engine']['venv']}/bin/python",
        "groups": [{"name": p["name"], "gpus": keep(p["gpus"])} for p in engines
                   if len(keep(p["gpus"])) > 1],
        "gpus": keep((host.get("gpu") or {}).get("used", [])),
        "sizes_mib": SIZES_MIB, "threshold": threshold, "timeout_s": timeout_s,
        "mem_fraction": mem_fraction, "expect": expect, "env": {**engine_env, **(env or {})},
        "ib_sysfs": ib_sysfs, "fabric": fabric(host, hosts or [], keep, port),
    }


def fabric(host: dict, hosts: list, keep, port: int) -> dict | None:
    """The all_reduce across every GPU host of the plan, where the plan moves data between
    hosts (RDMA: over InfiniBand) or spans an MNNVL domain; None otherwise."""
    used = {h["name"]: keep(h["gpu"]["used"]) for h in hosts if h.get("gpu")}
    gpu_hosts = [h for h in hosts if used.get(h["name"])]
    names = [h["name"] for h in gpu_hosts]
    over = "mnnvl" if host.get("imex") else "ib" if host.get("rdma") else None
    if len(names) < 2 or host["name"] not in names or over is None:
        return None
    return {"over": over, "hosts": names, "gpus_per_host": [len(used[n]) for n in names],
            "node_rank": names.index(host["name"]), "master": gpu_hosts[0]["address"],
            "port": port}


def rows(reports: dict[str, dict]) -> list[list[str]]:
    """The operator's table: one row per check and host."""
    def figure(value, unit):
        return "-" if value is None else f"{value:g} {unit}".strip()

    out = [["host", "check", "gpus", "what", "measured", "expected", "ratio", "verdict"]]
    for host, report in sorted(reports.items()):
        for c in report.get("checks", []):
            what = f"{c['size_mib']} MiB" if c.get("size_mib") else c.get("metric", "")
            unit = c.get("unit", "")
            out.append([host, f"{c['kind']} {c['name']}", ",".join(map(str, c["gpus"])) or "-",
                        what, figure(c.get("measured"), unit), figure(c.get("expected"), unit),
                        "-" if c.get("ratio") is None else f"{c['ratio']:.0%}", c["verdict"]])
    return out


def failures(reports: dict[str, dict]) -> list[str]:
    """host: what failed and what to do, one line each."""
    out = []
    for host, report in sorted(reports.items()):
        if report.get("error"):
            out.append(f"{host}: {report['error']}")
        out += [f"{host}: {c['kind']} {c['name']}: {c.get('detail') or 'failed'}"
                for c in report.get("checks", []) if c["verdict"] == "FAIL"]
    return out

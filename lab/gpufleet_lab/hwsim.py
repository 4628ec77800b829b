"""Simulated GPU/RDMA hardware for lab hosts, below the tools the roles call.

``render(profile, faults, hostname)`` returns ``{absolute path: (content, mode)}``
for the lab code to write into a host's overlay before it boots. One data file,
``/etc/gpufleet-lab/hw.json`` (the profile from ``hwsim_data/profiles.yml`` with
the faults applied), drives every simulated program; the programs are thin
``#!/usr/bin/python3`` wrappers around ``/usr/lib/gpufleet-lab/hwlab.py``.

Rendered programs: ``/usr/bin/nvidia-smi`` (``-q -x``, ``-q``, ``-L``,
``--query-gpu=... --format=csv[,noheader][,nounits]``, ``topo -m``, ``nvlink -s``,
``-pm 1``, and the summary table), ``/usr/bin/nv-fabricmanager``,
``/usr/bin/nvidia-imex``, ``/usr/bin/nvidia-imex-ctl`` (``-N``),
``/opt/nvidia/nvlsm/sbin/nvlsm`` (Blackwell HGX), ``/usr/bin/amd-smi``,
``/usr/bin/rocm-smi``, ``/usr/bin/ibv_devinfo``, ``/usr/sbin/ibstat``,
``/usr/local/sbin/lsmod`` and ``/usr/local/sbin/modprobe``, plus the systemd
units ``nvidia-fabricmanager.service`` and ``nvidia-imex.service`` (installed,
not enabled: enabling them is the roles' job) and their default configs.
NVIDIA hosts also get the site's ``/usr/bin/dcgm-exporter`` (NVIDIA's DCGM exporter:
GET /metrics on 0.0.0.0:9400, its default counters and labels per GPU, the last Xid
from this boot's kernel log; ``-a ADDRESS`` moves it) and its unit
``/etc/systemd/system/dcgm-exporter.service``, enabled at boot: a site runs it before
gpufleet arrives. Units under ``/etc/systemd/system`` are enabled by the lab code
(below); the others are not.

What the lab code must do besides writing the files:

* **Enabled units**: every unit rendered directly under ``/etc/systemd/system`` is
  enabled as ``systemctl enable`` would: a symlink in ``<target>.wants`` for each
  target of its ``[Install] WantedBy=``.

* **Device nodes**: a file write cannot create them. ``/etc/gpufleet-lab/devices``
  lists one character device per line as ``path major minor`` (``#`` starts a
  comment); create each with ``mknod -m 0666 path c major minor`` (parents
  0755). They exist to be found (``stat``, ``test -c``); nothing opens them, so
  do not grant the container access to those majors (no ``DeviceAllow=``).
  ``/dev/nvidia-nvswitchN`` exist only where the profile's host owns its NVSwitches
  (``nvswitches``); a virtual machine's (h200x2) belong to its hypervisor.
* **/proc/driver/nvidia/version**: procfs cannot be written and
  ``/proc/driver/nvidia`` does not exist in a host without the driver. Bind-mount
  the rendered directory ``/etc/gpufleet-lab/proc/driver`` read-only over
  ``/proc/driver`` (the same text is also at
  ``/etc/gpufleet-lab/proc-driver-nvidia-version`` for a single-file bind).
* **/proc/modules** (optional): ``/etc/gpufleet-lab/modules`` is kernel module
  state in ``/proc/modules`` format; the simulated ``lsmod``/``modprobe`` read and
  rewrite it in place, so a bind mount of it over ``/proc/modules`` stays current.

``GPUFLEET_LAB_ROOT`` (default ``/``) prefixes every path the programs touch,
which is how the unit tests run them in a temporary directory.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import uuid
from pathlib import Path

import yaml

DATA = Path(__file__).parent / "hwsim_data"
_SPEC = yaml.safe_load((DATA / "profiles.yml").read_text())
PROFILES: dict = _SPEC["profiles"]
FAULT_EFFECTS: dict = _SPEC["faults"]
# Every lab fault name; the ones under `elsewhere` are accepted and left to other lab parts.
FAULTS: tuple[str, ...] = tuple(sorted([*FAULT_EFFECTS, *_SPEC["elsewhere"]]))

LAB = "/etc/gpufleet-lab"
LIB = "/usr/lib/gpufleet-lab"
# The tools' implementation and the real captures it uses as templates.
LIB_FILES = ("hwlab.py", "nvidia-smi-q.xml", "nvidia-smi-table.txt", "topo.txt")

WRAPPER = """#!/usr/bin/python3
# gpufleet lab: simulated {tool} (see /etc/gpufleet-lab/hw.json)
import os
import sys

sys.path.insert(0, os.path.join(os.environ.get("GPUFLEET_LAB_ROOT", "/"), "{lib}"))
import hwlab  # noqa: E402

sys.exit(hwlab.main({tool!r}, sys.argv[1:]))
"""

# nvidia-ctk: the NVIDIA Container Toolkit's CLI (the image runtime's CDI spec), installed
# as a real host would have it from NVIDIA's repository
NVIDIA_TOOLS = {"/usr/bin/nvidia-smi": "nvidia-smi", "/usr/bin/nvidia-ctk": "nvidia-ctk"}
AMD_TOOLS = {"/usr/bin/amd-smi": "amd-smi", "/usr/bin/rocm-smi": "rocm-smi"}
COMMON_TOOLS = {
    "/usr/bin/ibv_devinfo": "ibv_devinfo",
    "/usr/sbin/ibstat": "ibstat",
    "/usr/local/sbin/lsmod": "lsmod",
    "/usr/local/sbin/modprobe": "modprobe",
}

FM_UNIT = """[Unit]
Description=NVIDIA fabric manager service (gpufleet lab simulation)
After=network-online.target

[Service]
Type=simple
ExecStart=/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg
Restart=no
LimitCORE=infinity

[Install]
WantedBy=multi-user.target
"""

# The site's dcgm-exporter, installed and enabled by the site (not by gpufleet), as NVIDIA's
# exporter runs on a host outside Kubernetes
DCGM_UNIT = """[Unit]
Description=NVIDIA DCGM exporter (gpufleet lab simulation)
After=network-online.target

[Service]
Type=simple
ExecStart=/usr/bin/dcgm-exporter
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""

IMEX_UNIT = """[Unit]
Description=NVIDIA IMEX service (gpufleet lab simulation)
After=network-online.target

[Service]
Type=simple
ExecStart=/usr/bin/nvidia-imex -c /etc/nvidia-imex/config.cfg
Restart=no
LimitCORE=infinity

[Install]
WantedBy=multi-user.target
"""

FM_CONFIG = """# Fabric manager configuration (lab simulation; keys as in the real package)
LOG_LEVEL=4
LOG_FILE_NAME=/var/log/fabricmanager.log
DAEMONIZE=1
BIND_INTERFACE_IP=127.0.0.1
STARTING_TCP_PORT=16000
FABRIC_MODE=0
FABRIC_MODE_RESTART=0
FM_STAY_RESIDENT_ON_FAILURES=0
"""

IMEX_CONFIG = """# nvidia-imex configuration (lab simulation; keys as in the real package)
LOG_LEVEL=4
LOG_FILE_NAME=/var/log/nvidia-imex.log
SERVER_PORT=50000
IMEX_CMD_ENABLED=1
IMEX_CMD_PORT=50005
IMEX_NODE_CONFIG_FILE=/etc/nvidia-imex/nodes_config.cfg
IMEX_WAIT_FOR_QUORUM=FULL
"""


def _digest(*parts: object) -> str:
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()


def _gpu_uuid(hostname: str, index: int) -> str:
    return f"GPU-{uuid.UUID(_digest('gpu', hostname, index)[:32])}"


def _guid(hostname: str, index: int) -> str:
    raw = _digest("hca", hostname, index)[:16]
    return ":".join(raw[i : i + 4] for i in range(0, 16, 4))


def build_hw(profile: str, faults: list[str], hostname: str) -> dict:
    """The resolved hardware description written to ``/etc/gpufleet-lab/hw.json``."""
    if profile not in PROFILES:
        raise ValueError(f"unknown hardware profile {profile!r}; valid: {', '.join(PROFILES)}")
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        raise ValueError(f"unknown fault(s) {', '.join(bad)}; valid: {', '.join(FAULTS)}")
    spec = copy.deepcopy(PROFILES[profile])
    effects: dict = {}
    for fault in faults:
        effects.update(FAULT_EFFECTS.get(fault, {}))
    gpu = spec["gpu"]
    count = len(spec["bus_ids"]) - effects.get("drop_gpus", 0)
    half = max(1, len(spec["bus_ids"]) // 2)
    gpus = []
    for index, bus_id in enumerate(spec["bus_ids"][:count]):
        gpus.append(
            {
                "index": index,
                "bus_id": bus_id,
                "uuid": _gpu_uuid(hostname, index),
                "serial": str(int(_digest("serial", hostname, index)[:12], 16))[:13].rjust(13, "1"),
                "minor": index,
                "module_id": index + 1,
                "numa": min(index // half, len(spec["numa_cpus"]) - 1),
                "cpus": spec["numa_cpus"][min(index // half, len(spec["numa_cpus"]) - 1)],
            }
        )
    ib = spec["ib"]
    hcas = []
    for index in range(effects.get("ib_count", ib["count"])):
        hcas.append(
            {
                "name": f"mlx5_{index}",
                "guid": _guid(hostname, index),
                "port_state": effects.get("ib_port_state", ib["port_state"]),
                "numa": index * 2 // max(1, ib["count"]),
                "gpu": index if index < count and ib["count"] == len(spec["bus_ids"]) else None,
            }
        )
    hw = {
        "profile": profile,
        "summary": spec["summary"],
        "hostname": hostname,
        "faults": sorted(faults),
        "vendor": spec["vendor"],
        "cpu_arch": spec["cpu_arch"],
        "gpu": gpu,
        "gpus": gpus,
        "ib": {**ib, "count": len(hcas)},
        "hcas": hcas,
        "modules": spec["modules"],
        "loadable_modules": spec["loadable_modules"],
        "peermem_error": bool(effects.get("peermem_error")),
    }
    if spec["vendor"] == "nvidia":
        driver = effects.get("driver_version", spec["driver"]["version"])
        fm = spec.get("fabric_manager")
        if fm:
            fm = {**fm, "version": effects.get("fabric_manager_version", driver)}
        hw.update(
            {
                "driver": {
                    "version": driver,
                    "cuda": effects.get("cuda_version", spec["driver"]["cuda"]),
                    "kernel_module": spec["driver"]["kernel_module"],
                    "dtd": effects.get("dtd", "nvsmi_device_v13.dtd"),
                },
                "fabric_manager": fm,
                "nvswitches": spec.get("nvswitches", 0),
                "fabric": {
                    **spec["fabric"],
                    **{
                        key: effects["fabric_" + key]
                        for key in ("state", "status")
                        if "fabric_" + key in effects
                    },
                },
                "imex": {
                    "enabled": True,
                    "peers_connected": effects.get("imex_peers_connected", True),
                }
                if spec["imex"]
                else None,
            }
        )
    else:
        hw["rocm"] = spec["rocm"]
    return hw


def proc_version_text(hw: dict) -> str:
    """``/proc/driver/nvidia/version`` as an open-kernel-module driver writes it."""
    driver = hw["driver"]
    flavor = (
        f"NVIDIA UNIX Open Kernel Module for {hw['cpu_arch']}"
        if driver["kernel_module"] == "open"
        else f"NVIDIA UNIX {hw['cpu_arch']} Kernel Module"
    )
    return (
        f"NVRM version: {flavor}  {driver['version']}  Release Build  "
        f"(dvs-builder@U22-I3-AE18-23-3)  Wed Oct  1 00:00:00 UTC 2026\n"
        "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
    )


def modules_text(names: list[str]) -> str:
    """Kernel module state in ``/proc/modules`` format."""
    lines = [f"{name} {4096 * (len(name) + 7)} 0 - Live 0x0000000000000000" for name in names]
    return "".join(line + "\n" for line in lines)


def devices(hw: dict) -> list[tuple[str, int, int]]:
    """Character devices the host should have: (path, major, minor)."""
    nodes: list[tuple[str, int, int]] = []
    if hw["vendor"] == "nvidia":
        nodes += [(f"/dev/nvidia{g['minor']}", 195, g["minor"]) for g in hw["gpus"]]
        nodes += [
            ("/dev/nvidiactl", 195, 255),
            ("/dev/nvidia-uvm", 510, 0),
            ("/dev/nvidia-uvm-tools", 510, 1),
        ]
        if hw.get("imex"):
            nodes.append(("/dev/nvidia-caps-imex-channels/channel0", 507, 0))
        if hw.get("nvswitches"):  # NVSwitches this host owns (not a VM's hypervisor's)
            nodes.append(("/dev/nvidia-nvswitchctl", 509, 255))
            nodes += [(f"/dev/nvidia-nvswitch{i}", 509, i) for i in range(hw["nvswitches"])]
    else:
        nodes.append(("/dev/kfd", 235, 0))
        for g in hw["gpus"]:
            nodes += [
                (f"/dev/dri/card{g['index']}", 226, g["index"]),
                (f"/dev/dri/renderD{128 + g['index']}", 226, 128 + g["index"]),
            ]
    if hw["hcas"]:
        nodes.append(("/dev/infiniband/rdma_cm", 10, 58))
    for index, _ in enumerate(hw["hcas"]):
        nodes += [
            (f"/dev/infiniband/uverbs{index}", 231, 192 + index),
            (f"/dev/infiniband/umad{index}", 231, index),
        ]
    return nodes


AMD_CONTAINERS_CONF = "/etc/containers/containers.conf.d/90-gpufleet-lab-gpus.conf"
AMD_CONTAINERS = f"""# gpufleet lab: the simulated GPUs, seen by every container (hwsim.py)
[containers]
volumes = ["{LAB}:{LAB}:ro", "{LIB}:{LIB}:ro"]
"""


# The HCAs' sysfs (/sys/class/infiniband/<hca>/ports/<n>/...) as files: a lab host's /sys is
# the controller's, read-only, so the health checker reads them here (health_ib_sysfs in
# inventories/lab); the health tests change the counters as a flapping link would.
IB_SYSFS = f"{LAB}/sys/class/infiniband"


def ib_speed(rate: int) -> str:
    """The InfiniBand speed name the kernel prints after a 4X port's rate (XDR: ConnectX-8)."""
    return "XDR" if rate >= 800 else "NDR" if rate >= 400 else "SDR"


def ib_sysfs(hw: dict) -> dict[str, tuple[bytes, int]]:
    files = {}
    ib = hw.get("ib") or {}
    for h in hw.get("hcas", []):
        port = f"{IB_SYSFS}/{h['name']}/ports/1"
        up = h["port_state"] == "Active"
        rate = ib["rate"] if up else 10
        values = {"state": "4: ACTIVE" if up else "1: DOWN",
                  "phys_state": "5: LinkUp" if up else "2: Polling",
                  "rate": f"{rate} Gb/sec (4X {ib_speed(rate)})",
                  "link_layer": ib["link_layer"]}
        values.update({f"counters/{c}": "0" for c in (
            "link_downed", "link_error_recovery", "symbol_error", "port_rcv_errors")})
        for name, text in values.items():
            files[f"{port}/{name}"] = (f"{text}\n".encode(), 0o644)
    return files


def render(profile: str, faults: list[str], hostname: str) -> dict[str, tuple[bytes, int]]:
    """Files for one lab host: ``{absolute path: (content, mode)}``."""
    hw = build_hw(profile, list(faults), hostname)
    files: dict[str, tuple[bytes, int]] = {
        f"{LAB}/hw.json": (json.dumps(hw, indent=2).encode() + b"\n", 0o644),
        f"{LAB}/modules": (modules_text(hw["modules"]).encode(), 0o644),
        f"{LAB}/devices": (
            (
                "# path major minor (character devices; gpufleet lab)\n"
                + "".join(f"{p} {ma} {mi}\n" for p, ma, mi in devices(hw))
            ).encode(),
            0o644,
        ),
    }
    for name in LIB_FILES:
        files[f"{LIB}/{name}"] = ((DATA / name).read_bytes(), 0o644)
    tools = dict(COMMON_TOOLS)
    if hw["vendor"] == "nvidia":
        tools.update(NVIDIA_TOOLS)
        proc = proc_version_text(hw).encode()
        files[f"{LAB}/proc/driver/nvidia/version"] = (proc, 0o444)
        files[f"{LAB}/proc-driver-nvidia-version"] = (proc, 0o444)
        if hw["fabric_manager"]:
            tools["/usr/bin/nv-fabricmanager"] = "nv-fabricmanager"
            files["/usr/share/nvidia/nvswitch/fabricmanager.cfg"] = (FM_CONFIG.encode(), 0o644)
            files["/lib/systemd/system/nvidia-fabricmanager.service"] = (FM_UNIT.encode(), 0o644)
            if hw["fabric_manager"].get("nvlsm"):
                tools["/opt/nvidia/nvlsm/sbin/nvlsm"] = "nvlsm"
        tools["/usr/bin/dcgm-exporter"] = "dcgm-exporter"
        files["/etc/systemd/system/dcgm-exporter.service"] = (DCGM_UNIT.encode(), 0o644)
        if hw["imex"]:
            tools["/usr/bin/nvidia-imex"] = "nvidia-imex"
            tools["/usr/bin/nvidia-imex-ctl"] = "nvidia-imex-ctl"
            files["/etc/nvidia-imex/config.cfg"] = (IMEX_CONFIG.encode(), 0o644)
            files["/lib/systemd/system/nvidia-imex.service"] = (IMEX_UNIT.encode(), 0o644)
    else:
        tools.update(AMD_TOOLS)
        rocm = hw["rocm"]
        files["/opt/rocm/.info/version"] = (f"{rocm['version']}-{rocm['build']}\n".encode(), 0o644)
        # a ROCm container given /dev/kfd and /dev/dri finds its GPUs in the host's sysfs
        # (the KFD topology), which every container sees; here that is the simulated
        # hardware, mounted into each container podman runs on the host (NVIDIA hosts get
        # it through the CDI spec, as the real toolkit mounts the driver's files)
        files[AMD_CONTAINERS_CONF] = (AMD_CONTAINERS.encode(), 0o644)
    for path, tool in tools.items():
        files[path] = (WRAPPER.format(tool=tool, lib=LIB.lstrip("/")).encode(), 0o755)
    files.update(ib_sysfs(hw))
    if hw["cpu_arch"] != platform.machine():
        # a Grace (aarch64) tray simulated on an x86-64 machine: `uname -m` tells the truth
        # of the simulated host, as nvidia-smi does for its GPUs
        files["/usr/local/bin/uname"] = (UNAME.format(arch=hw["cpu_arch"]).encode(), 0o755)
    return files


UNAME = """#!/bin/sh
# gpufleet lab: this host simulates a {arch} machine; the machine fields say so.
case " $* " in
  *" -m "*|*" -p "*|*" -i "*|*" --machine "*|*" --processor "*|*" --hardware-platform "*)
    [ "$#" -eq 1 ] && {{ echo {arch}; exit 0; }} ;;
esac
exec /bin/uname "$@"
"""

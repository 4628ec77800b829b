"""Parse GPU and RDMA tool output into one facts dict.

Stdlib only, Python 3.8+: Ansible ships this file to target hosts as
``ansible.module_utils.gpu_facts``; the controller, the lab simulator's tests
and the health checker import it as ``gpufleet.module_utils.gpu_facts``.

Every ``parse_*`` function takes the text a tool printed and returns plain
data; none of them runs anything. ``gpu_facts()`` and ``ib_facts()`` combine
what was available into the shapes the roles read (``gpufleet_gpu`` and
``gpufleet_ib``). Missing tools, missing elements and the many spellings of
"not available" ("N/A", "[N/A]", "Not Supported", absent elements) become
``None``; nothing here raises on odd input except a malformed XML document.
"""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET

NOT_AVAILABLE = {
    "",
    "n/a",
    "[n/a]",
    "not supported",
    "[not supported]",
    "unknown error",
    "[unknown error]",
    "none",
    "unknown",
}

# Model name fragment -> (arch, compute capability or gfx target).
# Checked in order, so longer names come before their prefixes.
MODEL_ARCH = (
    ("GB300", "blackwell", "10.3"),
    ("B300", "blackwell", "10.3"),
    ("GB200", "blackwell", "10.0"),
    ("B200", "blackwell", "10.0"),
    ("H200", "hopper", "9.0"),
    ("H100", "hopper", "9.0"),
    ("H800", "hopper", "9.0"),
    ("H20", "hopper", "9.0"),
    ("GH200", "hopper", "9.0"),
    ("A100", "ampere", "8.0"),
    ("MI355X", "cdna4", "gfx950"),
    ("MI350X", "cdna4", "gfx950"),
    ("MI325X", "cdna3", "gfx942"),
    ("MI300X", "cdna3", "gfx942"),
    ("MI300A", "cdna3", "gfx942"),
    ("MI250X", "cdna2", "gfx90a"),
    ("MI210", "cdna2", "gfx90a"),
)
GFX_ARCH = {
    "gfx950": "cdna4",
    "gfx942": "cdna3",
    "gfx941": "cdna3",
    "gfx940": "cdna3",
    "gfx90a": "cdna2",
}
CC_ARCH = {"10": "blackwell", "12": "blackwell", "9": "hopper", "8": "ampere"}

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def na(value):
    """Return ``value`` stripped, or None when it means "not available"."""
    if value is None:
        return None
    value = str(value).strip()
    return None if value.lower() in NOT_AVAILABLE else value


def to_int(value):
    """First integer in ``value`` ("143771 MiB" -> 143771), or None."""
    value = na(value)
    if value is None:
        return None
    match = re.search(r"-?\d+", value.replace(",", ""))
    return int(match.group(0)) if match else None


def to_float(value):
    value = na(value)
    if value is None:
        return None
    match = re.search(r"-?\d+(?:\.\d+)?", value)
    return float(match.group(0)) if match else None


def to_bool(value):
    """Enabled/Disabled, Yes/No, On/Off, true/false -> bool; else None."""
    value = na(value)
    if value is None:
        return None
    low = value.lower()
    if low in ("enabled", "yes", "on", "true", "1", "active"):
        return True
    if low in ("disabled", "no", "off", "false", "0", "not active"):
        return False
    return None


def arch_for(name, product_architecture=None, capability=None):
    """(arch, compute capability or gfx target) from whatever is known."""
    arch = na(product_architecture)
    arch = arch.lower() if arch else None
    cap = na(capability)
    upper = (name or "").upper()
    for fragment, frag_arch, frag_cap in MODEL_ARCH:
        if fragment in upper:
            return arch or frag_arch, cap or frag_cap
    if cap and cap.startswith("gfx"):
        return arch or GFX_ARCH.get(cap), cap
    if cap and not arch:
        arch = CC_ARCH.get(cap.split(".")[0])
    return arch, cap


# --------------------------------------------------------------------------- NVIDIA


def _text(node, path):
    if node is None:
        return None
    found = node.find(path)
    return None if found is None else na(found.text)


def _ecc_counts(node):
    """Sum ECC counters under a <volatile>/<aggregate> element.

    Drivers 525+ use flat tags (sram_correctable, dram_uncorrectable, ...);
    older ones nest <single_bit>/<double_bit>. Both end up as two sums.
    """
    result = {"correctable": None, "uncorrectable": None}

    def walk(element, path):
        for child in element:
            here = path + "/" + child.tag
            if len(child):
                walk(child, here)
                continue
            if not re.fullmatch(r"\s*\d+\s*", child.text or ""):
                continue
            if "uncorrectable" in here or "double_bit" in here:
                key = "uncorrectable"
            elif "correctable" in here or "single_bit" in here:
                key = "correctable"
            else:
                continue
            result[key] = (result[key] or 0) + int(child.text)

    if node is not None:
        walk(node, "")
    return result


PCIE = "pci/pci_gpu_link_info/"
# nvidia-smi -q -x <clocks_event_reasons> (older drivers: <clocks_throttle_reasons>, not read)
CLOCK_EVENTS = ("gpu_idle", "sw_power_cap", "hw_slowdown", "hw_thermal_slowdown",
                "hw_power_brake_slowdown", "sw_thermal_slowdown")


def parse_nvidia_smi_xml(text):
    """Parse ``nvidia-smi -q -x``."""
    root = ET.fromstring(text.strip())
    gpus = []
    for index, gpu in enumerate(root.findall("gpu")):
        fabric = gpu.find("fabric")
        ecc = gpu.find("ecc_errors")
        gpus.append(
            {
                "index": index,
                "bus_id": gpu.get("id"),
                "name": _text(gpu, "product_name"),
                "brand": _text(gpu, "product_brand"),
                "architecture": _text(gpu, "product_architecture"),
                "uuid": _text(gpu, "uuid"),
                "serial": _text(gpu, "serial"),
                "minor_number": to_int(_text(gpu, "minor_number")),
                "module_id": to_int(_text(gpu, "platformInfo/module_id")),
                "vbios_version": _text(gpu, "vbios_version"),
                "gsp_firmware_version": _text(gpu, "gsp_firmware_version"),
                "pci_device_id": _text(gpu, "pci/pci_device_id"),
                "persistence_mode": to_bool(_text(gpu, "persistence_mode")),
                "mig_mode": to_bool(_text(gpu, "mig_mode/current_mig")),
                "mig_mode_pending": to_bool(_text(gpu, "mig_mode/pending_mig")),
                "ecc_mode": to_bool(_text(gpu, "ecc_mode/current_ecc")),
                "ecc_mode_pending": to_bool(_text(gpu, "ecc_mode/pending_ecc")),
                "ecc_errors": {
                    "volatile": _ecc_counts(None if ecc is None else ecc.find("volatile")),
                    "aggregate": _ecc_counts(None if ecc is None else ecc.find("aggregate")),
                },
                "remapped_rows_pending": to_bool(_text(gpu, "remapped_rows/remapped_row_pending")),
                "remapped_rows_failure": to_bool(_text(gpu, "remapped_rows/remapped_row_failure")),
                "remapped_rows": {
                    "correctable": to_int(_text(gpu, "remapped_rows/remapped_row_corr")),
                    "uncorrectable": to_int(_text(gpu, "remapped_rows/remapped_row_unc")),
                },
                "retirement_pending": to_bool(_text(gpu, "retired_pages/pending_retirement")),
                "pcie": {
                    "gen_current": to_int(_text(gpu, PCIE + "pcie_gen/current_link_gen")),
                    "gen_max": to_int(_text(gpu, PCIE + "pcie_gen/max_link_gen")),
                    "width_current": to_int(_text(gpu, PCIE + "link_widths/current_link_width")),
                    "width_max": to_int(_text(gpu, PCIE + "link_widths/max_link_width")),
                },
                "clock_events": {
                    reason: to_bool(_text(gpu, "clocks_event_reasons/clocks_event_reason_"
                                          + reason))
                    for reason in CLOCK_EVENTS
                },
                "temperature_c": to_int(_text(gpu, "temperature/gpu_temp")),
                "memory_mib": to_int(_text(gpu, "fb_memory_usage/total")),
                "memory_used_mib": to_int(_text(gpu, "fb_memory_usage/used")),
                "power_limit_w": to_float(_text(gpu, "gpu_power_readings/current_power_limit")),
                "c2c_mode": to_bool(_text(gpu, "c2c_mode")),
                "fabric": {
                    "state": _text(fabric, "state"),
                    "status": _text(fabric, "status"),
                    "clique_id": _text(fabric, "cliqueId"),
                    "cluster_uuid": _text(fabric, "clusterUuid"),
                    "health": _text(fabric, "health/summary"),
                },
            }
        )
    return {
        "driver_version": na(root.findtext("driver_version")),
        "cuda_version": na(root.findtext("cuda_version")),
        "attached_gpus": to_int(root.findtext("attached_gpus")),
        "gpus": gpus,
    }


def parse_query_gpu(text, fields=None):
    """Parse ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]``.

    Without ``fields`` the first line must be the header. Header units
    ("memory.total [MiB]") and value units ("143771 MiB") are dropped.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if fields is None:
        if not lines:
            return []
        fields = [re.sub(r"\s*\[.*?\]\s*$", "", f.strip()) for f in lines[0].split(",")]
        lines = lines[1:]
    rows = []
    for line in lines:
        values = [na(v) for v in line.split(", ")]
        if len(values) != len(fields):
            values = [na(v) for v in line.split(",")]
        rows.append({f: values[i] if i < len(values) else None for i, f in enumerate(fields)})
    return rows


def parse_topo(text):
    """Parse ``nvidia-smi topo -m`` into a matrix keyed by device name.

    NICn columns are renamed to their HCA (``mlx5_0``) from the NIC Legend.
    """
    text = ANSI.sub("", text)
    lines = text.splitlines()
    header = None
    rows = {}
    affinity = {}
    nic_names = {}
    for line in lines:
        legend = re.match(r"\s*(NIC\d+):\s*(\S+)\s*$", line)
        if legend:
            nic_names[legend.group(1)] = legend.group(2)
            continue
        cells = [c.strip() for c in line.split("\t")]
        if header is None:
            if "GPU0" in cells:
                header = [c for c in cells if c]
            continue
        if not cells or not re.match(r"^(GPU\d+|NIC\d+|mlx5_\d+)$", cells[0]):
            if cells and cells[0].startswith("Legend"):
                header = header or []
            continue
        name, values = cells[0], cells[1:]
        rows[name] = {h: values[i] for i, h in enumerate(header) if i < len(values)}
    devices = [h for h in (header or []) if re.match(r"^(GPU\d+|NIC\d+|mlx5_\d+)$", h)]

    def rename(name):
        return nic_names.get(name, name)

    matrix = {}
    for row, cols in rows.items():
        matrix[rename(row)] = {rename(c): cols.get(c) for c in devices if c != row}
        if row.startswith("GPU"):
            affinity[row] = {
                "cpu": na(cols.get("CPU Affinity")),
                "numa": na(cols.get("NUMA Affinity")),
            }
    gpus = [d for d in devices if d.startswith("GPU")]
    nics = [rename(d) for d in devices if not d.startswith("GPU")]
    links = {matrix.get(a, {}).get(b) for a in gpus for b in gpus if a != b}
    return {
        "gpus": gpus,
        "nics": nics,
        "matrix": matrix,
        "affinity": affinity,
        "gpu_link": links.pop() if len(links) == 1 else None,
    }


def parse_nvlink_status(text):
    """Parse ``nvidia-smi nvlink -s`` (``--status``)."""
    gpus = []
    current = None
    for line in text.splitlines():
        head = re.match(r"GPU (\d+): (.*?)(?: \(UUID: (\S+)\))?\s*$", line)
        if head:
            current = {
                "index": int(head.group(1)),
                "name": head.group(2),
                "uuid": head.group(3),
                "links": [],
            }
            gpus.append(current)
            continue
        link = re.match(r"\s*Link (\d+): (.*)$", line)
        if link and current is not None:
            value = link.group(2).strip()
            speed = None if "inactive" in value.lower() else to_float(value)
            current["links"].append(
                {"link": int(link.group(1)), "active": speed is not None, "speed_gbps": speed}
            )
    return gpus


def parse_nvlink_errors(text):
    """Parse ``nvidia-smi nvlink -e``: {GPU index: {counter: sum over its links}}.

    Lines look like ``Link 3: Replay Errors: 0``; the counter is the name in snake case
    without "errors" (replay, recovery, crc; what a driver adds is kept under its own name).
    """
    out = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"GPU (\d+): ", line)
        if head:
            current = out.setdefault(int(head.group(1)), {})
            continue
        item = re.match(r"\s*Link \d+: ([^:]+): *(\S+)", line)
        if item and current is not None:
            name = re.sub(r"[^a-z0-9]+", "_", item.group(1).lower())
            name = re.sub(r"_?errors?$", "", name).strip("_") or "errors"
            value = to_int(item.group(2))
            if value is not None:
                current[name] = current.get(name, 0) + value
    return out


def parse_proc_driver_version(text):
    """Parse ``/proc/driver/nvidia/version``."""
    line = next((x for x in text.splitlines() if x.startswith("NVRM version")), "")
    version = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", line + " ")
    arch = re.search(r"(x86_64|aarch64|ppc64le)", line)
    return {
        "version": version.group(1) if version else None,
        "kernel_module": "open"
        if "Open Kernel Module" in line
        else ("proprietary" if line else None),
        "arch": arch.group(1) if arch else None,
    }


def parse_fabricmanager_version(text):
    """``nv-fabricmanager --version``: "Fabric Manager version is : 580.159.04"."""
    match = re.search(r"Fabric Manager version is\s*:\s*(\S+)", text or "")
    return match.group(1) if match else None


# NVSwitch: NVIDIA (0x10de) PCI functions of class "bridge, other" (0x0680); GPUs are 0x03xx.
NVIDIA_PCI_VENDOR = "0x10de"
NVSWITCH_PCI_CLASS = "0x0680"


def find_nvswitches(dev="/dev", pci="/sys/bus/pci/devices"):
    """NVSwitches this host owns: ``/dev/nvidia-nvswitchN`` device nodes, and NVSwitch PCI
    functions (visible before anything created the nodes). Sorted names; [] when none.

    A virtual machine on a shared NVSwitch system sees neither: the hypervisor keeps the
    switches and runs their fabric manager.
    """
    found = set()
    try:
        names = os.listdir(dev)
    except OSError:
        names = []
    found.update(os.path.join(dev, n) for n in names if re.fullmatch(r"nvidia-nvswitch\d+", n))
    try:
        functions = os.listdir(pci)
    except OSError:
        functions = []
    for function in functions:
        ids = []
        for attr in ("vendor", "class"):
            try:
                with open(os.path.join(pci, function, attr)) as handle:
                    ids.append(handle.read().strip().lower())
            except OSError:
                ids.append("")
        if ids[0] == NVIDIA_PCI_VENDOR and ids[1].startswith(NVSWITCH_PCI_CLASS):
            found.add("pci:" + function)
    return sorted(found)


def fabric_ok(fabric):
    """A GPU's (or the host's) NVLink fabric is up: state Completed, status Success."""
    fabric = fabric or {}
    return fabric.get("state") == "Completed" and fabric.get("status") == "Success"


def fabric_manager_mode(fabric, nvswitches):
    """Where this host's NVLink fabric is managed, the one rule every role and check uses.

    ``local``: the host sees NVSwitches (``nvswitches`` non-empty): its own
    nv-fabricmanager must run them. ``external``: no NVSwitch here, yet the GPUs report a
    fabric state: a hypervisor (shared NVSwitch virtualization) or the NVLink switch trays
    run the fabric; a fabric manager installed here would find no switch to manage.
    ``none``: neither: the GPUs are not on an NVSwitch fabric (PCIe cards, a one-GPU slice).
    """
    if nvswitches:
        return "local"
    if (fabric or {}).get("supported"):
        return "external"
    return "none"


def fabric_problem(facts, host="this host"):
    """For a host whose plan needs an NVSwitch fabric: why it cannot have one, naming the
    state and the fix; None where it can (it owns the switches and runs the fabric manager
    itself, or the fabric is managed outside it and up)."""
    mode = facts.get("fabric_manager")
    fabric = facts.get("fabric") or {}
    if mode in (None, "local") or (mode == "external" and fabric.get("ok")):
        return None  # undecided (no NVIDIA GPU facts), or nothing in the way
    if mode == "external":
        return (
            "the NVLink fabric of {host} is managed outside it (no /dev/nvidia-nvswitch*, no "
            "NVSwitch on PCI: a virtual machine on a shared NVSwitch system) and nvidia-smi -q "
            "reports Fabric State {state}, Status {status}; a fabric manager installed here "
            "would find no switch to manage. Fix: the hypervisor's fabric manager must bring "
            "this VM's GPU partition up (ask the provider, or stop and start the VM), then "
            "re-run".format(
                host=host,
                state=fabric.get("state") or "mixed/unknown",
                status=fabric.get("status") or "N/A",
            )
        )
    return (
        f"{host} shows no NVSwitch (no /dev/nvidia-nvswitch*, none on PCI) and its GPUs report "
        "no NVLink fabric (nvidia-smi -q: Fabric State N/A), but the target's hardware is an "
        "NVSwitch system. Fix: use hosts whose GPUs share an NVSwitch fabric (nvidia-smi topo "
        "-m shows NV# between them), or a target for this hardware"
    )


def parse_imex_status(text):
    """Parse ``nvidia-imex-ctl -N``: node states, connectivity and domain state."""
    nodes = []
    for match in re.finditer(
        r"^Node #(\d+)\s+-\s+(\S+)\s+-\s+(\S+)(?:\s+-\s+Version:\s*(\S+))?", text or "", re.M
    ):
        nodes.append(
            {
                "index": int(match.group(1)),
                "address": match.group(2),
                "state": match.group(3),
                "version": match.group(4),
            }
        )
    matrix = {}
    in_table = False
    for line in (text or "").splitlines():
        if "Nodes From" in line:
            in_table = True
            continue
        if in_table:
            cells = line.split()
            if not cells or not cells[0].isdigit():
                in_table = False
                continue
            matrix[int(cells[0])] = cells[1:]
    domain = re.search(r"Domain State:\s*(\S+)", text or "")
    connected = bool(matrix) and all(c == "C" for row in matrix.values() for c in row)
    return {
        "domain_state": domain.group(1) if domain else None,
        "nodes": nodes,
        "connectivity": matrix,
        "all_connected": connected,
    }


# --------------------------------------------------------------------------- AMD


def _value(item):
    """amd-smi wraps numbers as {"value": 288, "unit": "GB"}."""
    if isinstance(item, dict):
        return item.get("value")
    return item


def _to_mib(value, unit):
    number = to_float(value)
    if number is None:
        return None
    unit = (unit or "MB").upper()
    scale = {"B": 1.0 / 1048576, "KB": 1.0 / 1024, "MB": 1, "MIB": 1, "GB": 1024, "GIB": 1024}.get(
        unit, 1
    )
    return int(round(number * scale))


def parse_amd_smi_static(text):
    """Parse ``amd-smi static --json`` (ROCm 6.x: a list; ROCm 7.x: {"gpu_data": [...]})."""
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("gpu_data", [])
    gpus = []
    for entry in data:
        asic = entry.get("asic") or {}
        vram = entry.get("vram") or {}
        size = vram.get("size")
        unit = size.get("unit") if isinstance(size, dict) else "MB"
        driver = entry.get("driver") or {}
        gpus.append(
            {
                "index": entry.get("gpu"),
                "name": na(asic.get("market_name")),
                "gfx_target": na(asic.get("target_graphics_version")),
                "device_id": na(asic.get("device_id")),
                "compute_units": to_int(asic.get("num_compute_units")),
                "bus_id": na((entry.get("bus") or {}).get("bdf")),
                "memory_mib": _to_mib(_value(size), unit),
                "memory_type": na(vram.get("type")),
                "driver_version": na(driver.get("version")),
            }
        )
    return gpus


def parse_rocm_smi(text):
    """Parse ``rocm-smi --showproductname --showmeminfo vram --json``."""
    data = json.loads(text)
    gpus = []
    driver = None
    for key, card in sorted(data.items(), key=lambda kv: to_int(kv[0]) or 0):
        if not key.startswith("card"):
            if isinstance(card, dict):
                driver = na(card.get("Driver version")) or driver
            continue
        fields = {k.lower(): v for k, v in card.items()}
        total = to_int(fields.get("vram total memory (b)"))
        gpus.append(
            {
                "index": to_int(key),
                "name": na(fields.get("card series")) or na(fields.get("device name")),
                "gfx_target": na(fields.get("gfx version")),
                "memory_mib": None if total is None else total // 1048576,
            }
        )
    return {"driver_version": driver, "gpus": gpus}


# --------------------------------------------------------------------------- RDMA


def parse_ibv_devinfo(text):
    """Parse ``ibv_devinfo`` into HCAs with ports."""
    hcas = []
    hca = port = None
    for line in (text or "").splitlines():
        match = re.match(r"\s*([A-Za-z_]+):\s*(.*?)\s*$", line)
        if not match:
            continue
        key, value = match.group(1), match.group(2)
        if key == "hca_id":
            hca = {"name": value, "ports": []}
            hcas.append(hca)
            port = None
        elif hca is None:
            continue
        elif key == "port":
            port = {"port": int(value), "state": None, "link_layer": None}
            hca["ports"].append(port)
        elif port is not None:
            if key == "state":
                port["state"] = value.split()[0].replace("PORT_", "").capitalize()
            elif key in ("link_layer", "active_mtu", "port_lid", "sm_lid"):
                port[key] = value
        elif key in ("fw_ver", "node_guid", "transport", "vendor_part_id", "board_id"):
            hca[key] = value
    return hcas


def parse_ibstat(text):
    """Parse ``ibstat`` into the same shape as ``parse_ibv_devinfo``."""
    hcas = []
    hca = port = None
    for line in (text or "").splitlines():
        head = re.match(r"CA '([^']+)'", line)
        if head:
            hca = {"name": head.group(1), "ports": []}
            hcas.append(hca)
            port = None
            continue
        if hca is None:
            continue
        port_head = re.match(r"\s*Port (\d+):\s*$", line)
        if port_head:
            port = {"port": int(port_head.group(1)), "state": None, "link_layer": None}
            hca["ports"].append(port)
            continue
        match = re.match(r"\s*([A-Za-z ]+):\s*(.*?)\s*$", line)
        if not match:
            continue
        key, value = match.group(1).strip().lower(), match.group(2)
        if port is not None:
            if key == "state":
                port["state"] = value
            elif key == "physical state":
                port["phys_state"] = value
            elif key == "rate":
                port["rate_gbps"] = to_int(value)
            elif key == "link layer":
                port["link_layer"] = value
        elif key == "firmware version":
            hca["fw_ver"] = value
        elif key == "ca type":
            hca["ca_type"] = value
    return hcas


def parse_lsmod(text):
    """Loaded module names from ``lsmod`` or ``/proc/modules``."""
    names = []
    for line in (text or "").splitlines():
        cells = line.split()
        if not cells or cells[0] == "Module":
            continue
        names.append(cells[0])
    return names


# --------------------------------------------------------------------------- facts


def _all_same(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return values[0] if all(v == values[0] for v in values) else None


def _nvidia_facts(facts, xml, query, topo, nvlink, proc_version, fm_version, imex):
    parsed = parse_nvidia_smi_xml(xml) if xml else {"gpus": []}
    gpus = parsed["gpus"]
    rows = parse_query_gpu(query) if query else []
    by_uuid = {row.get("uuid"): row for row in rows}
    if not gpus and rows:
        gpus = [
            {
                "index": to_int(r.get("index")),
                "name": r.get("name"),
                "uuid": r.get("uuid"),
                "bus_id": r.get("pci.bus_id"),
                "memory_mib": to_int(r.get("memory.total")),
                "persistence_mode": to_bool(r.get("persistence_mode")),
                "ecc_mode": to_bool(r.get("ecc.mode.current")),
                "mig_mode": to_bool(r.get("mig.mode.current")),
                "fabric": {},
                "ecc_errors": {},
            }
            for r in rows
        ]
    for gpu in gpus:
        row = by_uuid.get(gpu.get("uuid")) or {}
        arch, cap = arch_for(gpu.get("name"), gpu.get("architecture"), row.get("compute_cap"))
        gpu["arch"], gpu["compute_capability"] = arch, cap
    proc = parse_proc_driver_version(proc_version) if proc_version else {}
    driver = parsed.get("driver_version") or _all_same([r.get("driver_version") for r in rows])
    driver = driver or proc.get("version")
    facts.update(
        {
            "vendor": "nvidia",
            "count": len(gpus),
            "driver_version": driver,
            "cuda_version": parsed.get("cuda_version"),
            "kernel_module": proc or None,
            "gpus": gpus,
        }
    )
    if gpus:
        fabric_states = [g.get("fabric", {}).get("state") for g in gpus]
        facts.update(
            {
                "model": _all_same([g.get("name") for g in gpus]) or gpus[0].get("name"),
                "arch": _all_same([g.get("arch") for g in gpus]),
                "compute_capability": _all_same([g.get("compute_capability") for g in gpus]),
                "memory_mib": min(
                    (g["memory_mib"] for g in gpus if g.get("memory_mib")), default=None
                ),
                "persistence_mode": all(g.get("persistence_mode") for g in gpus),
                "ecc_mode": all(g.get("ecc_mode") for g in gpus),
                "mig_mode": any(g.get("mig_mode") for g in gpus),
                "ecc_errors": {
                    "volatile_uncorrectable": sum(
                        g["ecc_errors"].get("volatile", {}).get("uncorrectable") or 0
                        for g in gpus
                        if g.get("ecc_errors")
                    ),
                    "aggregate_uncorrectable": sum(
                        g["ecc_errors"].get("aggregate", {}).get("uncorrectable") or 0
                        for g in gpus
                        if g.get("ecc_errors")
                    ),
                },
                "fabric": {
                    "state": _all_same(fabric_states),
                    "status": _all_same([g.get("fabric", {}).get("status") for g in gpus]),
                    "clique_id": _all_same([g.get("fabric", {}).get("clique_id") for g in gpus]),
                    "cluster_uuid": _all_same(
                        [g.get("fabric", {}).get("cluster_uuid") for g in gpus]
                    ),
                    "completed": all(s == "Completed" for s in fabric_states),
                    "ok": all(fabric_ok(g.get("fabric")) for g in gpus),
                    "supported": any(s is not None for s in fabric_states),
                },
            }
        )
    if topo:
        facts["topology"] = parse_topo(topo)
    if nvlink:
        links = parse_nvlink_status(nvlink)
        per_gpu = [len([x for x in g["links"] if x["active"]]) for g in links]
        facts["nvlink"] = {
            "gpus": links,
            "active_links_per_gpu": per_gpu,
            "inactive_links": sum(len(g["links"]) for g in links) - sum(per_gpu),
        }
    facts["fabric_manager_version"] = parse_fabricmanager_version(fm_version)
    if facts["fabric_manager_version"] and driver:
        facts["fabric_manager_matches_driver"] = facts["fabric_manager_version"] == driver
    if imex:
        facts["imex"] = parse_imex_status(imex)


def _amd_facts(facts, amd_static, rocm_smi, rocm_version):
    gpus = parse_amd_smi_static(amd_static) if amd_static else []
    driver = None
    if not gpus and rocm_smi:
        parsed = parse_rocm_smi(rocm_smi)
        gpus, driver = parsed["gpus"], parsed["driver_version"]
    for gpu in gpus:
        gpu["arch"], gpu["gfx_target"] = arch_for(gpu.get("name"), None, gpu.get("gfx_target"))
    facts.update(
        {
            "vendor": "amd",
            "count": len(gpus),
            "model": _all_same([g.get("name") for g in gpus]),
            "arch": _all_same([g.get("arch") for g in gpus]),
            "gfx_target": _all_same([g.get("gfx_target") for g in gpus]),
            "memory_mib": min((g["memory_mib"] for g in gpus if g.get("memory_mib")), default=None),
            "driver_version": driver or _all_same([g.get("driver_version") for g in gpus]),
            "rocm_version": na((rocm_version or "").split("-")[0]),
            "gpus": gpus,
        }
    )


def empty_gpu_facts():
    return {
        "present": False,
        "vendor": None,
        "count": 0,
        "model": None,
        "arch": None,
        "compute_capability": None,
        "gfx_target": None,
        "memory_mib": None,
        "driver_version": None,
        "cuda_version": None,
        "rocm_version": None,
        "kernel_module": None,
        "persistence_mode": None,
        "ecc_mode": None,
        "mig_mode": None,
        "ecc_errors": None,
        "fabric": None,
        "topology": None,
        "nvlink": None,
        "fabric_manager_version": None,
        "nvswitches": None,
        "fabric_manager": None,
        "fabric_problem": None,
        "imex": None,
        "gpus": [],
    }


def gpu_facts(
    xml=None,
    query=None,
    topo=None,
    nvlink=None,
    proc_version=None,
    fm_version=None,
    imex=None,
    amd_static=None,
    rocm_smi=None,
    rocm_version=None,
    nvswitches=None,
):
    """Combine whatever tool output is available into ``gpufleet_gpu``.

    ``nvswitches`` is ``find_nvswitches()`` on the host; with it, NVIDIA hosts get
    ``fabric_manager`` (``fabric_manager_mode``: local, external or none).
    """
    facts = empty_gpu_facts()
    if xml or query:
        _nvidia_facts(facts, xml, query, topo, nvlink, proc_version, fm_version, imex)
    elif amd_static or rocm_smi:
        _amd_facts(facts, amd_static, rocm_smi, rocm_version)
    elif proc_version:
        facts["vendor"] = "nvidia"
        facts["kernel_module"] = parse_proc_driver_version(proc_version)
        facts["driver_version"] = facts["kernel_module"]["version"]
    facts["present"] = facts["count"] > 0
    if nvswitches is not None:
        facts["nvswitches"] = list(nvswitches)
        if facts["vendor"] == "nvidia":
            facts["fabric_manager"] = fabric_manager_mode(facts["fabric"], nvswitches)
            facts["fabric_problem"] = fabric_problem(facts)
    return facts


def ib_facts(ibv_devinfo=None, ibstat=None, lsmod=None):
    """Combine ``ibv_devinfo`` (preferred) or ``ibstat`` and loaded modules."""
    hcas = parse_ibv_devinfo(ibv_devinfo) if ibv_devinfo else []
    if not hcas and ibstat:
        hcas = parse_ibstat(ibstat)
    active = [h["name"] for h in hcas if any(p.get("state") == "Active" for p in h["ports"])]
    modules = parse_lsmod(lsmod) if lsmod is not None else None
    return {
        "present": bool(hcas),
        "count": len(hcas),
        "hcas": hcas,
        "active": active,
        "all_active": bool(hcas) and len(active) == len(hcas),
        "link_layers": sorted(
            {p.get("link_layer") for h in hcas for p in h["ports"] if p.get("link_layer")}
        ),
        "peermem_loaded": None if modules is None else "nvidia_peermem" in modules,
        "modules": modules,
    }

"""gpufleet lab: simulated GPU, fabric and RDMA tools for one lab host.

Installed as /usr/lib/gpufleet-lab/hwlab.py by gpufleet_lab.hwsim; every tool
(/usr/bin/nvidia-smi, ibstat, modprobe, ...) is a small wrapper that calls
``main(tool, args)``. Everything comes from /etc/gpufleet-lab/hw.json; state
that tools change (persistence mode, loaded modules, running daemons) lives in
/var/lib/gpufleet-lab, /etc/gpufleet-lab/modules and /run/gpufleet-lab.
Output formats follow the real tools; the nvidia-smi XML is the real H200
capture (nvidia-smi-q.xml next to this file) with per-GPU values substituted.
Stdlib only. GPUFLEET_LAB_ROOT prefixes every path (tests run it in a tmpdir).
"""

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time

ROOT = os.environ.get("GPUFLEET_LAB_ROOT", "/")
HERE = os.path.dirname(os.path.abspath(__file__))

NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


def path(p):
    return os.path.join(ROOT, p.lstrip("/"))


def load_hw():
    with open(path("/etc/gpufleet-lab/hw.json")) as f:
        return json.load(f)


def read(p, default=""):
    try:
        with open(path(p)) as f:
            return f.read()
    except OSError:
        return default


def write(p, text):
    full = path(p)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    # In place (no rename): /etc/gpufleet-lab/modules may be bind-mounted over /proc/modules.
    with open(full, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(text)


def loaded_modules():
    return [line.split()[0] for line in read("/etc/gpufleet-lab/modules").splitlines() if line]


def daemon_running(name):
    pid = read(f"/run/gpufleet-lab/{name}.pid").strip()
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_daemon(name, serve=None):
    """Write the pid file, serve (or sleep) until SIGTERM, remove the pid file."""
    write(f"/run/gpufleet-lab/{name}.pid", f"{os.getpid()}\n")

    def stop(*_):
        with contextlib.suppress(OSError):
            os.unlink(path(f"/run/gpufleet-lab/{name}.pid"))
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if serve:
        serve()
    while True:
        time.sleep(3600)


def log(name, text):
    sys.stderr.write(text + "\n")
    stamp = time.strftime("%b %d %Y %H:%M:%S")
    try:
        os.makedirs(path("/var/log"), exist_ok=True)
        with open(path(f"/var/log/{name}.log"), "a") as f:
            f.write(f"[{stamp}] {text}\n")
    except OSError:
        pass


# --------------------------------------------------------------------------- nvidia-smi


# Faults a GPU develops while the host runs (the health tests inject them): per GPU index,
# values of the nvidia-smi -q -x tags that change (the first tag of that name in the GPU's
# block: volatile ECC before aggregate, the fabric's <status>), NVLink links down and error
# counters. {"xml": {"1": {"remapped_row_pending": "Yes"}}, "nvlink_inactive": {"0": [17]},
#  "nvlink_errors": {"1": {"Recovery Errors": 1}}}
# AMD (amd-smi): error counts per RAS block, a block's RAS state, temperatures, XGMI links
# down (by peer GPU): {"amd_ecc_blocks": {"1": {"UMC": {"uncorrectable_count": 3}}},
#  "amd_ras_state": {"0": {"GFX": "MULT_UC"}}, "amd_temperature": {"0": {"hotspot": 107}},
#  "amd_xgmi_down": {"1": [3]}}
GPU_FAULTS = "/var/lib/gpufleet-lab/gpu-faults.json"


def gpu_faults():
    try:
        return json.loads(read(GPU_FAULTS) or "{}")
    except ValueError:
        return {}


def persistence(hw):
    return read("/var/lib/gpufleet-lab/persistence").strip() == "1"


def fabric(hw):
    """(state, status, cliqueId, clusterUuid, health) as the driver reports it now."""
    fab = hw["fabric"]
    fm = hw.get("fabric_manager")
    if fm and not daemon_running("nv-fabricmanager"):
        return "In Progress", "N/A", "N/A", "N/A", "N/A"
    if fab.get("state"):  # a fabric run outside the host, in the state a fault put it
        return fab["state"], fab.get("status", "N/A"), "N/A", "N/A", "N/A"
    health = fab.get("health", "Healthy")
    return "Completed", "Success", fab["clique_id"], fab["cluster_uuid"], health


def sub(block, tag, value):
    return re.sub(rf"<{tag}>[^<]*</{tag}>", f"<{tag}>{value}</{tag}>", block, count=1)


def sub_in(block, parent, tag, value):
    start = block.index(f"<{parent}>")
    end = block.index(f"</{parent}>", start)
    return block[:start] + sub(block[start:end], tag, value) + block[end:]


def nvsmi_xml(hw, gpus):
    with open(os.path.join(HERE, "nvidia-smi-q.xml")) as f:
        template = f.read()
    head, rest = template.split("\t<gpu id=", 1)
    gpu_block = "\t<gpu id=" + rest[: rest.index("</gpu>") + len("</gpu>")] + "\n"
    tail = rest[rest.index("</gpu>") + len("</gpu>") :].lstrip("\n")
    drv, spec = hw["driver"], hw["gpu"]
    head = re.sub(r"nvsmi_device_v\d+\.dtd", drv["dtd"], head)
    head = sub(head, "timestamp", time.strftime("%a %b %d %H:%M:%S %Y"))
    head = sub(head, "driver_version", drv["version"])
    head = sub(head, "cuda_version", drv["cuda"])
    head = sub(head, "attached_gpus", str(len(gpus)))
    state, status, clique, cluster, health = fabric(hw)
    pm = "Enabled" if persistence(hw) else "Disabled"
    faults = gpu_faults()
    blocks = []
    for g in gpus:
        domain, bus, devfn = g["bus_id"].split(":")
        b = re.sub(r'<gpu id="[^"]*">', '<gpu id="{}">'.format(g["bus_id"]), gpu_block)
        for tag, value in (
            ("product_name", spec["name"]),
            ("product_architecture", spec["architecture"]),
            ("persistence_mode", pm),
            ("serial", g["serial"]),
            ("uuid", g["uuid"]),
            ("minor_number", g["minor"]),
            ("vbios_version", spec["vbios_version"]),
            ("module_id", g["module_id"]),
            ("gsp_firmware_version", drv["version"]),
            ("pci_bus", bus),
            ("pci_device", devfn.split(".")[0]),
            ("pci_domain", domain[-4:]),
            ("pci_device_id", spec["pci_device_id"]),
            ("pci_bus_id", g["bus_id"]),
            ("pci_sub_system_id", spec["pci_sub_system_id"]),
            ("c2c_mode", spec["c2c_mode"]),
            ("state", state),
            ("status", status),
            ("cliqueId", clique),
            ("clusterUuid", cluster),
            ("summary", health),
        ):
            b = sub(b, tag, value)
        total, reserved = spec["memory_mib"], spec["reserved_mib"]
        for tag, value in (
            ("total", f"{total} MiB"),
            ("reserved", f"{reserved} MiB"),
            ("used", "0 MiB"),
            ("free", f"{total - reserved} MiB"),
        ):
            b = sub_in(b, "fb_memory_usage", tag, value)
        watts = "{:.2f} W".format(spec["power_limit_w"])
        for tag in (
            "current_power_limit",
            "requested_power_limit",
            "default_power_limit",
            "max_power_limit",
        ):
            b = sub_in(b, "gpu_power_readings", tag, watts)
        for tag, value in faults.get("xml", {}).get(str(g["index"]), {}).items():
            b = sub(b, tag, value)
        blocks.append(b)
    return head + "".join(blocks) + "\n" + tail


def nvsmi_text(hw, gpus):
    drv, spec = hw["driver"], hw["gpu"]
    state, status, clique, cluster, health = fabric(hw)
    pm = "Enabled" if persistence(hw) else "Disabled"
    out = ["", "==============NVSMI LOG==============", ""]

    def kv(indent, key, value):
        out.append(("    " * indent + key).ljust(55) + ": " + str(value))

    kv(0, "Timestamp", time.strftime("%a %b %d %H:%M:%S %Y"))
    kv(0, "Driver Version", drv["version"])
    kv(0, "CUDA Version", drv["cuda"])
    out.append("")
    kv(0, "Attached GPUs", len(gpus))
    for g in gpus:
        out.append("GPU " + g["bus_id"])
        kv(1, "Product Name", spec["name"])
        kv(1, "Product Brand", "NVIDIA")
        kv(1, "Product Architecture", spec["architecture"])
        kv(1, "Persistence Mode", pm)
        out.append("    MIG Mode")
        kv(2, "Current", "Disabled")
        kv(2, "Pending", "Disabled")
        kv(1, "Serial Number", g["serial"])
        kv(1, "GPU UUID", g["uuid"])
        kv(1, "Minor Number", g["minor"])
        kv(1, "VBIOS Version", spec["vbios_version"])
        kv(1, "GSP Firmware Version", drv["version"])
        out.append("    FB Memory Usage")
        kv(2, "Total", f"{spec['memory_mib']} MiB")
        kv(2, "Reserved", f"{spec['reserved_mib']} MiB")
        kv(2, "Used", "0 MiB")
        kv(2, "Free", f"{spec['memory_mib'] - spec['reserved_mib']} MiB")
        out.append("    ECC Mode")
        kv(2, "Current", "Enabled")
        kv(2, "Pending", "Enabled")
        out.append("    Fabric")
        kv(2, "State", state)
        kv(2, "Status", status)
        kv(2, "CliqueId", clique)
        kv(2, "ClusterUUID", cluster)
        out.append("        Health")
        kv(3, "Summary", health)
    return "\n".join(out) + "\n"


def template(name):
    with open(os.path.join(HERE, name)) as f:
        return f.read()


def nvsmi_table(hw, gpus):
    """The summary table, framed by the lines of the real capture (nvidia-smi-table.txt)."""
    real = template("nvidia-smi-table.txt").splitlines()
    drv, spec = hw["driver"], hw["gpu"]
    sep = real[3]
    pm = "On" if persistence(hw) else "Off"
    name, ver = spec["name"], drv["version"]
    usage, cap = f"{spec['power_limit_w'] // 6}W", f"{spec['power_limit_w']}W"
    total = f"{spec['memory_mib']}MiB"
    lines = [time.strftime("%a %b %d %H:%M:%S %Y       "), real[1]]
    lines.append(f"| NVIDIA-SMI {ver:<23}Driver Version: {ver:<15}CUDA Version: {drv['cuda']:<9}|")
    lines += real[3:8]
    for g in gpus:
        lines += [
            f"|{g['index']:>4}  {name:<29}{pm:>4}  |{g['bus_id']:>19} {'Off':>3} |{'0':>21} |",
            f"| {'N/A':<3}{'34C':>6}{'P0':>6}{usage:>16} / {cap:>5} "
            f"|{'0MiB':>11} / {total:>9} |{'0%':>8}{'Default':>13} |",
            f"|{'':41}|{'':24}|{'Disabled':>21} |",
            sep,
        ]
    lines += real[12:]
    return "\n".join(lines) + "\n"


def nvsmi_topo(hw, gpus):
    hcas = hw["hcas"]
    link = f"NV{hw['gpu']['nvlink_links']}"
    names = [f"GPU{g['index']}" for g in gpus] + [f"NIC{i}" for i in range(len(hcas))]
    lines = [
        "\x1b[4m\t"
        + "\t".join(names + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])
        + "\x1b[0m"
    ]

    def pci(a_numa, b_numa, same):
        return "PIX" if same else ("NODE" if a_numa == b_numa else "SYS")

    for g in gpus:
        cells = [" X " if o is g else link for o in gpus]
        cells += [pci(g["numa"], h["numa"], h["gpu"] == g["index"]) for h in hcas]
        lines.append(f"GPU{g['index']}\t" + "\t".join(cells) + f"\t{g['cpus']}\t{g['numa']}\t\tN/A")
    for i, h in enumerate(hcas):
        cells = [pci(h["numa"], g["numa"], h["gpu"] == g["index"]) for g in gpus]
        cells += [" X " if j == i else pci(h["numa"], o["numa"], False) for j, o in enumerate(hcas)]
        lines.append(f"NIC{i}\t" + "\t".join(cells) + "\t\t\t\t")
    legend = template("topo.txt")
    text = "\n".join(lines) + "\n" + legend[legend.index("\nLegend:") :]
    if hcas:
        text += "\nNIC Legend:\n\n" + "".join(
            f"  NIC{i}: {h['name']}\n" for i, h in enumerate(hcas)
        )
    return text


def nvsmi_nvlink(hw, gpus, errors=False):
    """nvlink -s (each link's speed, or <inactive>) or -e (each link's error counters)."""
    spec = hw["gpu"]
    faults = gpu_faults()
    out = []
    for g in gpus:
        out.append(f"GPU {g['index']}: {spec['name']} (UUID: {g['uuid']})")
        down = faults.get("nvlink_inactive", {}).get(str(g["index"]), [])
        counts = faults.get("nvlink_errors", {}).get(str(g["index"]), {})
        for n in range(spec["nvlink_links"]):
            if errors:  # a fault's counts land on link 0
                out += [f"\t Link {n}: {name}: {counts.get(name, 0) if n == 0 else 0}"
                        for name in ("Replay Errors", "Recovery Errors", "CRC Errors")]
            else:
                out.append(f"\t Link {n}: " + ("<inactive>" if n in down else spec["nvlink_speed"]))
    return "\n".join(out) + "\n"


QUERY_UNITS = {
    "memory.total": "MiB",
    "memory.used": "MiB",
    "memory.free": "MiB",
    "memory.reserved": "MiB",
    "clocks.max.sm": "MHz",
    "clocks.max.graphics": "MHz",
    "clocks.max.memory": "MHz",
    "power.limit": "W",
    "power.draw": "W",
    "utilization.gpu": "%",
    "utilization.memory": "%",
}


def query_value(hw, g, field, count):
    spec, drv = hw["gpu"], hw["driver"]
    pm = "Enabled" if persistence(hw) else "Disabled"
    values = {
        "index": g["index"],
        "name": spec["name"],
        "gpu_name": spec["name"],
        "uuid": g["uuid"],
        "gpu_uuid": g["uuid"],
        "serial": g["serial"],
        "pci.bus_id": g["bus_id"],
        "gpu_bus_id": g["bus_id"],
        "count": count,
        "driver_version": drv["version"],
        "vbios_version": spec["vbios_version"],
        "compute_cap": spec["compute_cap"],
        "persistence_mode": pm,
        "ecc.mode.current": "Enabled",
        "ecc.mode.pending": "Enabled",
        "mig.mode.current": "Disabled",
        "mig.mode.pending": "Disabled",
        "ecc.errors.uncorrected.volatile.total": 0,
        "ecc.errors.uncorrected.aggregate.total": 0,
        "memory.total": spec["memory_mib"],
        "memory.reserved": spec["reserved_mib"],
        "memory.used": 0,
        "memory.free": spec["memory_mib"] - spec["reserved_mib"],
        "clocks.max.sm": 1980,
        "clocks.max.graphics": 1980,
        "clocks.max.memory": 3201,
        "power.limit": "{:.2f}".format(spec["power_limit_w"]),
        "power.draw": "78.25",
        "utilization.gpu": 0,
        "utilization.memory": 0,
        "temperature.gpu": 32,
        "pstate": "P0",
        "compute_mode": "Default",
        "fabric.state": fabric(hw)[0],
        "fabric.status": fabric(hw)[1],
    }
    return values.get(field)


def nvsmi_query(hw, gpus, fields, fmt):
    opts = fmt.split(",")
    if "csv" not in opts:
        sys.stderr.write(f'"{fmt}" is not a valid format.\n')
        return 2
    for field in fields:
        if query_value(hw, gpus[0], field, len(gpus)) is None:
            sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
            return 2
    units = "nounits" not in opts
    if "noheader" not in opts:
        sys.stdout.write(
            ", ".join(f + (f" [{QUERY_UNITS[f]}]" if f in QUERY_UNITS else "") for f in fields)
            + "\n"
        )
    for g in gpus:
        row = []
        for f in fields:
            value = str(query_value(hw, g, f, len(gpus)))
            if units and f in QUERY_UNITS:
                value += " " + QUERY_UNITS[f]
            row.append(value)
        sys.stdout.write(", ".join(row) + "\n")
    return 0


def nvidia_smi(hw, args):
    if "nvidia" not in loaded_modules():
        sys.stdout.write(NO_DRIVER)
        return 9
    gpus = hw["gpus"]
    if "-i" in args or "--id" in args:
        key = "-i" if "-i" in args else "--id"
        wanted = args[args.index(key) + 1].split(",")
        gpus = [
            g
            for g in gpus
            if str(g["index"]) in wanted or g["uuid"] in wanted or g["bus_id"] in wanted
        ]
        if not gpus:
            sys.stdout.write("No devices were found\n")
            return 6
        at = args.index(key)
        args = args[:at] + args[at + 2 :]
    opts = {}
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            opts[key] = value
    for key in ("--query-gpu", "--format"):
        if key in args:
            opts[key] = args[args.index(key) + 1]
    if not args:
        sys.stdout.write(nvsmi_table(hw, gpus))
    elif "--version" in args:
        drv = hw["driver"]
        sys.stdout.write(
            "NVIDIA-SMI version  : {}\nNVML version        : {}\n"
            "DRIVER version      : {}\nCUDA Version        : {}\n".format(
                drv["version"], drv["version"].rsplit(".", 1)[0], drv["version"], drv["cuda"]
            )
        )
    elif args[0] in ("-L", "--list-gpus"):
        for g in gpus:
            sys.stdout.write(f"GPU {g['index']}: {hw['gpu']['name']} (UUID: {g['uuid']})\n")
    elif "--query-gpu" in opts:
        if "--format" not in opts:
            sys.stdout.write('"--format" option must be specified when using --query-gpu.\n')
            return 2
        return nvsmi_query(hw, gpus, opts["--query-gpu"].split(","), opts["--format"])
    elif args[0] in ("-q", "--query"):
        xml = "-x" in args or "--xml-format" in args
        sys.stdout.write(nvsmi_xml(hw, gpus) if xml else nvsmi_text(hw, gpus))
    elif args[0] == "topo" and ("-m" in args or "--matrix" in args):
        sys.stdout.write(nvsmi_topo(hw, gpus))
    elif args[0] == "nvlink" and ("-s" in args or "--status" in args):
        sys.stdout.write(nvsmi_nvlink(hw, gpus))
    elif args[0] == "nvlink" and ("-e" in args or "--errorcounters" in args):
        sys.stdout.write(nvsmi_nvlink(hw, gpus, errors=True))
    elif args[0] in ("-pm", "--persistence-mode") or "--persistence-mode" in opts:
        value = opts.get("--persistence-mode") or args[1]
        enable = value in ("1", "ENABLED", "Enabled")
        if os.geteuid() != 0 and not os.environ.get("GPUFLEET_LAB_ROOT"):
            sys.stdout.write(
                "Unable to set persistence mode for GPU {}: Insufficient Permissions\n"
                "Terminating early due to previous errors.\n".format(gpus[0]["bus_id"])
            )
            return 4
        before = persistence(hw)
        write("/var/lib/gpufleet-lab/persistence", "1\n" if enable else "0\n")
        word = "Enabled" if enable else "Disabled"
        for g in gpus:
            if before == enable:
                sys.stdout.write(
                    "Persistence mode is already {} for GPU {}.\n".format(word, g["bus_id"])
                )
            else:
                sys.stdout.write("{} persistence mode for GPU {}.\n".format(word, g["bus_id"]))
        sys.stdout.write("All done.\n")
    else:
        sys.stdout.write(
            "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n"
        )
        return 2
    return 0


# --------------------------------------------------------------------------- fabric, IMEX


def nv_fabricmanager(hw, args):
    fm = hw.get("fabric_manager")
    if "--version" in args or "-v" in args:
        sys.stdout.write("Fabric Manager version is : {}\n".format(fm["version"]))
        return 0
    driver = hw["driver"]["version"]
    if "nvidia" not in loaded_modules():
        log("fabricmanager", "fabric manager failed to open NVIDIA driver: no such device")
        return 1
    if fm["version"] != driver:
        log(
            "fabricmanager",
            "[ERROR] fabric manager NVIDIA GPU driver interface version {} don't match with "
            "driver version {}. Please update with matching NVIDIA driver package.".format(
                fm["version"], driver
            ),
        )
        return 1
    if fm.get("nvlsm") and not os.path.exists(path("/opt/nvidia/nvlsm/sbin/nvlsm")):
        log(
            "fabricmanager",
            "[ERROR] NVLink subnet manager (nvlsm) not found; "
            "Blackwell NVLink fabrics need the nvlsm package",
        )
        return 1
    log(
        "fabricmanager",
        "Successfully configured all the available NVSwitches to route GPU "
        "NVLink traffic. NVLink Peer-to-Peer support will be enabled once the GPUs are "
        "successfully registered with the NVLink fabric.",
    )
    return run_daemon("nv-fabricmanager")


def nvlsm(hw, args):
    sys.stdout.write(
        "nvlsm version {}\n".format(hw["fabric_manager"].get("nvlsm_version", "unknown"))
    )
    return 0


def imex_config(args):
    cfg_path = args[args.index("-c") + 1] if "-c" in args else "/etc/nvidia-imex/config.cfg"
    cfg = {}
    for line in read(cfg_path).splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            cfg[key.strip()] = value.strip()
    nodes_file = cfg.get("IMEX_NODE_CONFIG_FILE", "/etc/nvidia-imex/nodes_config.cfg")
    nodes = [
        n.strip()
        for n in read(nodes_file).splitlines()
        if n.strip() and not n.strip().startswith("#")
    ]
    return cfg, nodes_file, nodes


def nvidia_imex(hw, args):
    if "--version" in args or "-v" in args:
        sys.stdout.write("IMEX version is: {}\n".format(hw["driver"]["version"]))
        return 0
    cfg, nodes_file, nodes = imex_config(args)
    if not nodes:
        log(
            "nvidia-imex",
            f"[ERROR] IMEX node configuration file {nodes_file} is missing or empty",
        )
        return 1
    if "nvidia" not in loaded_modules():
        log("nvidia-imex", "[ERROR] Failed to open the NVIDIA driver")
        return 1
    port = int(cfg.get("SERVER_PORT", "50000"))
    log(
        "nvidia-imex",
        f"IMEX version {hw['driver']['version']} is running with {len(nodes)} node(s)",
    )

    def serve():
        if not hw["imex"]["peers_connected"]:
            return
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(64)
        while True:
            conn, _ = srv.accept()
            conn.close()

    return run_daemon("nvidia-imex", serve)


def is_local(address):
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def reachable(address, port):
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


IMEX_LEGEND = """Connectivity Table Legend:
I - Invalid - Node wasn't reachable, no connection status available
N - Never Connected
R - Recovering - Connection was lost, but clean up has not yet been triggered.
D - Disconnected - Connection was lost, and clean up has been triggreed.
A - Authenticating - If GSSAPI enabled, client has initiated mutual authentication.
!V! - Version mismatch, communication disabled.
!M! - Node map mismatch, communication disabled.
C - Connected - Ready for operation
"""


def nvidia_imex_ctl(hw, args):
    if not ("-N" in args or "-n" in args or "-q" in args):
        sys.stdout.write("Usage: nvidia-imex-ctl [-c <config path>] <-n|-N|-q|-s>\n")
        return 1
    if not daemon_running("nvidia-imex"):
        sys.stdout.write("Failed to connect to the IMEX command service: Connection refused\n")
        return 1
    if "-q" in args:
        sys.stdout.write("READY\n")
        return 0
    cfg, _, nodes = imex_config(args)
    port = int(cfg.get("SERVER_PORT", "50000"))
    up = hw["imex"]["peers_connected"]
    ready = [is_local(n) or (up and reachable(n, port)) for n in nodes]
    now = time.localtime()
    out = [
        IMEX_LEGEND,
        f"{now.tm_mon}/{now.tm_mday}/{now.tm_year} "
        f"{time.strftime('%H:%M:%S', now)}.{int(time.time() * 1000) % 1000:03d}",
        "Nodes:",
    ]
    for i, node in enumerate(nodes):
        state = "READY" if ready[i] else "UNAVAILABLE"
        line = f"{'Node #' + str(i):<9} - {node:<15} - {state:<20}"
        out.append(
            (line + " - Version: {}".format(hw["driver"]["version"])) if ready[i] else line.rstrip()
        )
    out += ["", " Nodes From\\To  " + "".join(f"{i:<4}" for i in range(len(nodes))).rstrip()]
    for i in range(len(nodes)):
        row = ["C" if ready[i] and ready[j] and (up or i == j) else "N" for j in range(len(nodes))]
        out.append(f"{i:>8}        " + "".join(f"{c:<4}" for c in row).rstrip())
    connected = all(ready) and up
    out += ["", "Domain State: " + ("UP" if connected else "DOWN")]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


# --------------------------------------------------------------------------- AMD


# the RAS blocks amd-smi counts ECC errors of (amdsmi_commands.py: sysfs_blocks)
AMD_RAS_BLOCKS = ("UMC", "SDMA", "GFX", "MMHUB", "PCIE_BIF", "HDP", "XGMI_WAFL")


def amd_subsystem_id(spec):
    """The profile's PCI subsystem ID; profiles without one print what the simulator always
    printed."""
    return spec.get("subsystem_id", "0x0c34")


def amd_fault(name, g):
    return gpu_faults().get(name, {}).get(str(g["index"]), {})


def amd_static(hw):
    spec, rocm = hw["gpu"], hw["rocm"]
    return [
        {
            "gpu": g["index"],
            "asic": {
                "market_name": spec["name"],
                "vendor_id": "0x1002",
                "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
                "subvendor_id": "0x1002",
                "device_id": spec["device_id"],
                "subsystem_id": amd_subsystem_id(spec),
                "rev_id": "0x00",
                "asic_serial": "0x" + g["serial"].rjust(16, "0"),
                "oam_id": g["index"],
                "num_compute_units": spec["compute_units"],
                "target_graphics_version": spec["gfx_target"],
            },
            "bus": {
                "bdf": g["bus_id"],
                "max_pcie_width": 16,
                "max_pcie_speed": {"value": 32, "unit": "GT/s"},
                "pcie_interface_version": "Gen 5",
                "slot_type": "OAM",
            },
            "driver": {"name": "amdgpu", "version": rocm["amdgpu_version"]},
            "vram": {
                "type": spec["vram_type"],
                "vendor": "SAMSUNG",
                "size": {"value": spec["memory_mib"], "unit": "MB"},
                "bit_width": 8192,
            },
            "ras": {
                "eeprom_version": "0x30000",
                "parity_schema": "DISABLED",
                "single_bit_schema": "DISABLED",
                "double_bit_schema": "DISABLED",
                "poison_schema": "ENABLED",
                "ecc_block_state": {
                    **dict.fromkeys(AMD_RAS_BLOCKS, "ENABLED"),
                    **amd_fault("amd_ras_state", g),
                },
            },
            "numa": {"node": g["numa"], "affinity": g["numa"]},
        }
        for g in hw["gpus"]
    ]


def amd_metric(hw, args):
    """`amd-smi metric` with -t, -e, -k (all three without one): a healthy MI3xx idles at
    hotspot 40s C, edge N/A (MI300 on), no ECC errors; the faults file changes them."""
    wanted = {
        name
        for short, long, name in (("-t", "--temperature", "temperature"), ("-e", "--ecc", "ecc"),
                                  ("-k", "--ecc-blocks", "ecc_blocks"))
        if short in args or long in args
    } or {"temperature", "ecc", "ecc_blocks"}
    out = []
    for g in hw["gpus"]:
        temps = {"edge": "N/A", "hotspot": 41 + g["index"], "mem": 35 + g["index"]}
        temps.update(amd_fault("amd_temperature", g))
        blocks = {}
        for block in AMD_RAS_BLOCKS:
            counts = {"correctable_count": 0, "uncorrectable_count": 0, "deferred_count": 0}
            counts.update(amd_fault("amd_ecc_blocks", g).get(block, {}))
            blocks[block] = counts
        total = {
            kind: sum(b[kind + "_count"] for b in blocks.values())
            for kind in ("correctable", "uncorrectable", "deferred")
        }
        entry = {"gpu": g["index"]}
        if "temperature" in wanted:
            entry["temperature"] = {
                k: v if v == "N/A" else {"value": v, "unit": "C"} for k, v in temps.items()
            }
        if "ecc" in wanted:
            entry["ecc"] = {
                "total_correctable_count": total["correctable"],
                "total_uncorrectable_count": total["uncorrectable"],
                "total_deferred_count": total["deferred"],
                "cache_correctable_count": total["correctable"]
                - blocks["UMC"]["correctable_count"],
                "cache_uncorrectable_count": total["uncorrectable"]
                - blocks["UMC"]["uncorrectable_count"],
            }
        if "ecc_blocks" in wanted:
            entry["ecc_blocks"] = blocks
        out.append(entry)
    return out


def amd_xgmi_status(hw):
    """`amd-smi xgmi --link-status` as amd-smi 26.x gives it: per peer GPU, SELF for
    itself, U (up) or D (down: a fault)."""
    return [
        {
            "gpu": g["index"],
            "bdf": g["bus_id"],
            "link_status": [
                "SELF" if p is g else ("D" if p["index"] in amd_fault("amd_xgmi_down", g) else "U")
                for p in hw["gpus"]
            ],
        }
        for g in hw["gpus"]
    ]


def yamlish(value, indent=0):
    out = []
    for key, item in value.items():
        if isinstance(item, dict) and set(item) == {"value", "unit"}:
            out.append(
                "    " * indent + "{}: {} {}".format(key.upper(), item["value"], item["unit"])
            )
        elif isinstance(item, dict):
            out.append("    " * indent + key.upper() + ":")
            out += yamlish(item, indent + 1)
        else:
            out.append("    " * indent + f"{key.upper()}: {item}")
    return out


def amd_smi(hw, args):
    rocm = hw["rocm"]
    if "amdgpu" not in loaded_modules():
        sys.stderr.write("AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded\n")
        return 1
    as_json = "--json" in args
    cmd = args[0] if args else ""
    if cmd == "version":
        info = {
            "tool": "AMDSMI Tool",
            "version": rocm["amd_smi_version"],
            "amdsmi_library_version": rocm["amd_smi_version"],
            "rocm_version": rocm["version"],
            "amdgpu_version": rocm["amdgpu_version"],
        }
        if as_json:
            sys.stdout.write(json.dumps([info], indent=4) + "\n")
        else:
            sys.stdout.write(
                "AMDSMI Tool: {} | AMDSMI Library version: {} | ROCm version: {} | "
                "amdgpu version: {}\n".format(
                    rocm["amd_smi_version"],
                    rocm["amd_smi_version"],
                    rocm["version"],
                    rocm["amdgpu_version"],
                )
            )
    elif cmd == "static":
        data = amd_static(hw)
        if as_json:
            sys.stdout.write(json.dumps({"gpu_data": data}, indent=4) + "\n")
        else:
            for entry in data:
                entry = dict(entry)
                sys.stdout.write(f"GPU: {entry.pop('gpu')}\n")
                sys.stdout.write("\n".join(yamlish(entry, 1)) + "\n\n")
    elif cmd == "metric" and as_json:
        sys.stdout.write(json.dumps({"gpu_data": amd_metric(hw, args)}, indent=4) + "\n")
    elif cmd == "xgmi" and as_json and ("-l" in args or "--link-status" in args):
        sys.stdout.write(json.dumps({"link_status": amd_xgmi_status(hw)}, indent=4) + "\n")
    elif cmd in ("metric", "xgmi"):
        sys.stderr.write(f"amd-smi {cmd}: unsupported here (gpufleet lab): {' '.join(args)}\n")
        return 2
    elif cmd == "list":
        rows = [
            {
                "gpu": g["index"],
                "bdf": g["bus_id"],
                "uuid": g["uuid"][4:],
                "kfd_id": 1000 + g["index"],
                "node_id": g["index"] + 1,
                "partition_id": 0,
            }
            for g in hw["gpus"]
        ]
        if as_json:
            sys.stdout.write(json.dumps(rows, indent=4) + "\n")
        else:
            for r in rows:
                sys.stdout.write(f"GPU: {r['gpu']}\n    BDF: {r['bdf']}\n    UUID: {r['uuid']}\n\n")
    else:
        sys.stdout.write("usage: amd-smi [-h] {version,list,static,metric,xgmi} ...\n")
        return 2 if args else 0
    return 0


def rocm_smi(hw, args):
    spec = hw["gpu"]
    if "amdgpu" not in loaded_modules():
        sys.stdout.write("ERROR:root:Driver not initialized (amdgpu not found in modules)\n")
        return 1
    cards = {}
    for g in hw["gpus"]:
        card = {}
        if "--showproductname" in args:
            card.update(
                {
                    "Card Series": spec["name"],
                    "Card Model": spec["device_id"],
                    "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
                    "Card SKU": "MI3SKU",
                    "Subsystem ID": amd_subsystem_id(spec),
                    "Device Rev": "0x00",
                    "Node ID": str(g["index"] + 2),
                    "GUID": str(1000 + g["index"]),
                    "GFX Version": spec["gfx_target"],
                }
            )
        if "--showmeminfo" in args:
            card.update(
                {
                    "VRAM Total Memory (B)": str(spec["memory_mib"] * 1048576),
                    "VRAM Total Used Memory (B)": "294912000",
                }
            )
        cards[f"card{g['index']}"] = card
    if "--json" in args:
        result = dict(cards)
        if "--showdriverversion" in args:
            result["system"] = {"Driver version": hw["rocm"]["amdgpu_version"]}
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    bar = "=" * 28
    out = ["", bar + " ROCm System Management Interface " + bar]
    for key, card in cards.items():
        for name, value in card.items():
            out.append(f"GPU[{key[4:]}]\t\t: {name}: {value}")
    out.append("=" * 89)
    out.append("=" * 34 + " End of ROCm SMI Log " + "=" * 34)
    sys.stdout.write("\n".join(out) + "\n")
    return 0


# --------------------------------------------------------------------------- RDMA, modules


def ibv_devinfo(hw, args):
    hcas = hw["hcas"]
    if "-d" in args:
        hcas = [h for h in hcas if h["name"] == args[args.index("-d") + 1]]
    if not hcas:
        sys.stderr.write("No IB devices found\n")
        return 255
    ib = hw["ib"]
    out = []
    for h in hcas:
        active = h["port_state"] == "Active"
        out += [
            "hca_id:\t{}".format(h["name"]),
            "\ttransport:\t\t\tInfiniBand (0)",
            "\tfw_ver:\t\t\t\t{}".format(ib["fw_ver"]),
            "\tnode_guid:\t\t\t{}".format(h["guid"]),
            "\tsys_image_guid:\t\t\t{}".format(h["guid"]),
            "\tvendor_id:\t\t\t0x02c9",
            "\tvendor_part_id:\t\t\t{}".format(ib["vendor_part_id"]),
            "\thw_ver:\t\t\t\t0x0",
            "\tboard_id:\t\t\tMT_0000000838",
            "\tphys_port_cnt:\t\t\t1",
            "\t\tport:\t1",
            "\t\t\tstate:\t\t\t%s" % ("PORT_ACTIVE (4)" if active else "PORT_DOWN (1)"),
            "\t\t\tmax_mtu:\t\t4096 (5)",
            "\t\t\tactive_mtu:\t\t4096 (5)",
            "\t\t\tsm_lid:\t\t\t%s" % (1 if active else 0),
            "\t\t\tport_lid:\t\t%s" % (hw["hcas"].index(h) + 10 if active else 65535),
            "\t\t\tport_lmc:\t\t0x00",
            "\t\t\tlink_layer:\t\t{}".format(ib["link_layer"]),
            "",
        ]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def ibstat(hw, args):
    hcas = hw["hcas"]
    if "-l" in args:
        sys.stdout.write("".join(h["name"] + "\n" for h in hcas))
        return 0
    names = [a for a in args if not a.startswith("-")]
    if names:
        hcas = [h for h in hcas if h["name"] == names[0]]
        if not hcas:
            sys.stderr.write(
                f"ibpanic: [{os.getpid()}] main: '{names[0]}' IB device can't be found: Success\n"
            )
            return 255
    ib = hw["ib"]
    out = []
    for i, h in enumerate(hcas):
        guid = "0x" + h["guid"].replace(":", "")
        active = h["port_state"] == "Active"
        out += [
            "CA '{}'".format(h["name"]),
            "\tCA type: {}".format(ib["ca_type"]),
            "\tNumber of ports: 1",
            "\tFirmware version: {}".format(ib["fw_ver"]),
            "\tHardware version: 0",
            f"\tNode GUID: {guid}",
            f"\tSystem image GUID: {guid}",
            "\tPort 1:",
            "\t\tState: %s" % ("Active" if active else "Down"),
            "\t\tPhysical state: %s" % ("LinkUp" if active else "Polling"),
            "\t\tRate: %s" % (ib["rate"] if active else 10),
            f"\t\tBase lid: {i + 10 if active else 65535}",
            "\t\tLMC: 0",
            f"\t\tSM lid: {1 if active else 0}",
            "\t\tCapability mask: 0xa751e848",
            f"\t\tPort GUID: {guid}",
            "\t\tLink layer: {}".format(ib["link_layer"]),
        ]
    sys.stdout.write("\n".join(out) + ("\n" if out else ""))
    return 0


def lsmod(hw, args):
    out = ["Module                  Size  Used by"]
    for line in read("/etc/gpufleet-lab/modules").splitlines():
        cells = line.split()
        if cells:
            deps = "" if cells[3] == "-" else " " + cells[3].rstrip(",")
            out.append(f"{cells[0]:<19} {cells[1]:>8}  {cells[2]}{deps}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def real_modprobe(args):
    for candidate in ("/usr/sbin/modprobe", "/sbin/modprobe"):
        if os.path.exists(candidate) and ROOT == "/":
            os.execv(candidate, ["modprobe"] + args)
    return None


def modprobe(hw, args):
    flags = [a for a in args if a.startswith("-")]
    names = [a for a in args if not a.startswith("-") and "=" not in a]
    if not names:
        sys.stderr.write("modprobe: ERROR: missing parameters. See -h.\n")
        return 1
    remove = "-r" in flags or "--remove" in flags
    known = set(hw["modules"]) | set(hw["loadable_modules"])
    loaded = loaded_modules()
    targets = names if remove else names[:1]
    for name in targets:
        name = name.replace("-", "_")
        if name not in known and real_modprobe(args) is None:
            sys.stderr.write(
                f"modprobe: FATAL: Module {name} not found in directory "
                f"/lib/modules/{os.uname().release}\n"
            )
            return 1
        if remove:
            loaded = [m for m in loaded if m != name]
            continue
        if name in loaded:
            continue
        if name == "nvidia_peermem" and hw["peermem_error"]:
            sys.stderr.write(
                "nvidia_peermem: disagrees about version of symbol "
                "ib_register_peer_memory_client\n"
                "nvidia_peermem: Unknown symbol ib_register_peer_memory_client "
                "(err -22)\n"
                "modprobe: ERROR: could not insert 'nvidia_peermem': "
                "Invalid argument\n"
            )
            return 1
        loaded.append(name)
    text = read("/etc/gpufleet-lab/modules")
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    lines = [rows.get(m, f"{m} {4096 * (len(m) + 7)} 0 - Live 0x0000000000000000") for m in loaded]
    write("/etc/gpufleet-lab/modules", "".join(line + "\n" for line in lines))
    return 0


# ---------------------------------------------------------------- nvidia-ctk

CTK_VERSION = "1.17.8"
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
CDI_NAME = re.compile(r'^- name: "?([^"\s]+)"?\s*$')
CDI_KIND = re.compile(r"^kind: (\S+)\s*$")


def cdi_spec(hw):
    """The spec `nvidia-ctk cdi generate` writes (CDI 0.5.0): one device per GPU and `all`,
    the control nodes for every container, and the driver's tools mounted in (here: the
    simulated nvidia-smi and what it reads, as the real toolkit mounts the real one)."""
    def nodes(paths, indent):
        return "".join(f"{indent}- path: {p}\n" for p in paths)
    gpus = [f"/dev/nvidia{g['minor']}" for g in hw["gpus"]]
    out = ["---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n"]
    for g in hw["gpus"]:
        out.append(f'- name: "{g["index"]}"\n  containerEdits:\n    deviceNodes:\n'
                   + nodes([f"/dev/nvidia{g['minor']}"], "    "))
    out.append("- name: all\n  containerEdits:\n    deviceNodes:\n" + nodes(gpus, "    "))
    mounts = ["/usr/bin/nvidia-smi", "/usr/lib/gpufleet-lab", "/etc/gpufleet-lab"]
    out.append("containerEdits:\n  env:\n  - NVIDIA_VISIBLE_DEVICES=void\n  deviceNodes:\n"
               + nodes(["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"], "  ")
               + "  mounts:\n" + "".join(
                   f"  - hostPath: {m}\n    containerPath: {m}\n"
                   "    options: [ro, nosuid, nodev, bind]\n" for m in mounts))
    return "".join(out)


def cdi_devices():
    """Fully qualified device names of the specs in the CDI directories."""
    names = []
    for d in CDI_DIRS:
        try:
            files = sorted(os.listdir(path(d)))
        except OSError:
            continue
        for name in files:
            if not name.endswith((".yaml", ".yml", ".json")):
                continue
            kind = None
            for line in read(os.path.join(d, name)).splitlines():
                m = CDI_KIND.match(line)
                if m:
                    kind = m.group(1)
                m = CDI_NAME.match(line)
                if m and kind:
                    names.append(f"{kind}={m.group(1)}")
    return names


def nvidia_ctk(hw, args):
    if args[:1] in (["--version"], ["-v"]):
        sys.stdout.write(f"NVIDIA Container Toolkit CLI version {CTK_VERSION}\ncommit: lab\n")
        return 0
    if args[:2] == ["cdi", "generate"]:
        if "nvidia" not in loaded_modules():
            sys.stderr.write("ERRO[0000] failed to generate CDI spec: failed to create device CDI "
                             "specs: failed to initialize NVML: ERROR_LIBRARY_NOT_FOUND\n")
            return 1
        output = None
        rest = args[2:]
        for i, a in enumerate(rest):
            if a.startswith("--output="):
                output = a.split("=", 1)[1]
            elif a == "--output" and i + 1 < len(rest):
                output = rest[i + 1]
        spec = cdi_spec(hw)
        if output:
            write(output, spec)
            sys.stderr.write(f'INFO[0000] Generated CDI spec with version 0.5.0\n'
                             f'INFO[0000] Wrote CDI spec to "{output}"\n')
        else:
            sys.stdout.write(spec)
        return 0
    if args[:2] == ["cdi", "list"]:
        names = cdi_devices()
        sys.stderr.write(f"INFO[0000] Found {len(names)} CDI devices\n")
        sys.stdout.write("".join(n + "\n" for n in names))
        return 0
    sys.stderr.write(f"nvidia-ctk: unsupported here (gpufleet lab): {' '.join(args)}\n")
    return 2


# ---------------------------------------------------------------- dcgm-exporter

# dcgm-exporter 4.x's default counters (its etc/default-counters.csv, the uncommented rows):
# field, Prometheus type, help text, in the file's order. DCGM_FI_DRIVER_VERSION (a
# `label` row) becomes a label of every series. Left out: DCGM_FI_DEV_FB_RESERVED, so
# that FB_USED + FB_FREE is the total as with the driver's reservation counted as used
# (dcgm_values).
DCGM_COUNTERS = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
     "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "gauge",
     "Total number of NVLink bandwidth counters for all lanes."),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for uncorrectable errors"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge",
     "Ratio of cycles the tensor (HMMA) pipe is active."),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
     "Ratio of cycles the device memory interface is active sending or receiving data."),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
     "The rate of data transmitted over the PCIe bus - including both protocol headers and "
     "data payloads - in bytes per second."),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
     "The rate of data received over the PCIe bus - including both protocol headers and "
     "data payloads - in bytes per second."),
)
# DCGM's double-valued fields, which the exporter prints with %f (the others are int64)
DCGM_DOUBLES = {"DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE"}
DCGM_LISTEN = ":9400"  # the real default (-a / DCGM_EXPORTER_LISTEN)
XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
JOURNAL_KERNEL = ["journalctl", "-k", "-o", "json", "--output-fields=MESSAGE", "-q",
                  "--no-pager"]


def pci_key(address):
    """A GPU's PCI address as the kernel names it in an Xid: 00000000:18:00.0 and
    PCI:0000:18:00 both give 0000:18:00."""
    parts = address.lower().replace("pci:", "").split(".")[0].split(":")
    if len(parts) != 3:
        return address.lower()
    return "{}:{}:{}".format(parts[0][-4:].rjust(4, "0"), parts[1].rjust(2, "0"),
                             parts[2].rjust(2, "0"))


def last_xids():
    """{pci key: code of the last Xid} from this boot's kernel log (the lab puts Xids
    there: gpufleet_lab.hosts.kernel_message); {} when the journal cannot be read."""
    import subprocess

    try:
        out = subprocess.run(JOURNAL_KERNEL, capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    codes = {}
    for line in out.splitlines():
        try:
            message = json.loads(line).get("MESSAGE") or ""
        except (ValueError, AttributeError):
            continue
        if isinstance(message, list):  # journald's form of a message that is not UTF-8
            message = bytes(message).decode("utf-8", "replace")
        m = XID.search(message)
        if m:
            codes[pci_key(m.group(1))] = int(m.group(2))
    return codes


def dcgm_values(hw, g, xids):
    """One GPU's fields, idle: the readings of the real capture nvidia-smi answers with
    (or what a fault put into them, gpu-faults.json), the last Xid from the kernel log."""
    spec = hw["gpu"]
    fault = gpu_faults().get("xml", {}).get(str(g["index"]), {})

    def num(tag, default):
        m = re.match(r"\s*(-?\d+(?:\.\d+)?)", str(fault.get(tag, default)))
        return float(m.group(1)) if m else 0.0

    watts = num("average_power_draw", 78.25)
    total, reserved = spec["memory_mib"], spec["reserved_mib"]
    values = {
        "DCGM_FI_DEV_SM_CLOCK": num("sm_clock", 345),
        "DCGM_FI_DEV_MEM_CLOCK": num("mem_clock", 3201),
        "DCGM_FI_DEV_MEMORY_TEMP": num("memory_temp", 33),
        "DCGM_FI_DEV_GPU_TEMP": num("gpu_temp", 32),
        "DCGM_FI_DEV_POWER_USAGE": watts,
        # the board's energy counter runs since the driver came up: here, since boot
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": watts * time.clock_gettime(
            time.CLOCK_BOOTTIME) * 1000,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
        "DCGM_FI_DEV_GPU_UTIL": 0,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 0,
        "DCGM_FI_DEV_ENC_UTIL": 0,
        "DCGM_FI_DEV_DEC_UTIL": 0,
        "DCGM_FI_DEV_XID_ERRORS": xids.get(pci_key(g["bus_id"]), 0),
        # no process on the GPU: the driver's reservation is all that is used, the rest free
        # (nvidia-smi's Free), so used + free is the board's memory
        "DCGM_FI_DEV_FB_FREE": total - reserved,
        "DCGM_FI_DEV_FB_USED": reserved,
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS": 0,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": num("remapped_row_unc", 0),
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": num("remapped_row_corr", 0),
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": int(fault.get("remapped_row_failure") == "Yes"),
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.0,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.0,
        "DCGM_FI_PROF_PCIE_TX_BYTES": 0,
        "DCGM_FI_PROF_PCIE_RX_BYTES": 0,
    }
    if spec.get("nvlink_links"):  # a field the GPU does not have is left out, as DCGM does
        values["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] = 0
    return values


def prom_label(value):
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def dcgm_metrics(hw):
    """The /metrics page as dcgm-exporter 4.x renders it: per field its HELP and TYPE, then
    one series per GPU labelled gpu, UUID, pci_bus_id, device, modelName, Hostname and
    the driver version."""
    hostname = os.environ.get("NODE_NAME") or socket.gethostname()
    driver = (hw.get("driver") or {}).get("version")
    xids = last_xids()
    rows = []
    for g in hw["gpus"]:
        labels = [("gpu", g["index"]), ("UUID", g["uuid"]), ("pci_bus_id", g["bus_id"]),
                  ("device", f"nvidia{g['index']}"), ("modelName", hw["gpu"]["name"]),
                  ("Hostname", hostname)]
        if driver:
            labels.append(("DCGM_FI_DRIVER_VERSION", driver))
        text = ",".join(f'{k}="{prom_label(v)}"' for k, v in labels)
        rows.append((text, dcgm_values(hw, g, xids)))
    out = []
    for name, kind, help_text in DCGM_COUNTERS:
        series = [(text, values[name]) for text, values in rows if name in values]
        if not series:
            continue
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for text, value in series:
            shown = f"{value:f}" if name in DCGM_DOUBLES else f"{int(value)}"
            out.append(f"{name}{{{text}}} {shown}")
    return "\n".join(out) + "\n"


DCGM_INDEX = b"""<html>
<head><title>GPU Exporter</title></head>
<body>
<h1>GPU Exporter</h1>
<p><a href="./metrics">Metrics</a></p>
</body>
</html>"""


def dcgm_exporter(hw, args):
    """NVIDIA's dcgm-exporter below the interface Prometheus scrapes: GET /metrics on
    -a/--address (default :9400, as the real one; also $DCGM_EXPORTER_LISTEN). The
    counters are the default set; -f/--collectors is accepted and not read."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    address = os.environ.get("DCGM_EXPORTER_LISTEN") or DCGM_LISTEN
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        key, eq, value = arg.partition("=")
        if key in ("-a", "--address", "-f", "--collectors"):
            if not eq:
                if not rest:
                    sys.stderr.write(f"Incorrect Usage: flag needs an argument: {arg}\n")
                    return 1
                value = rest.pop(0)
            if key in ("-a", "--address"):
                address = value
        else:
            sys.stderr.write(f"Incorrect Usage: flag provided but not defined: {arg}\n")
            return 1
    if "nvidia" not in loaded_modules():
        sys.stderr.write("dcgm-exporter: cannot initialize DCGM: the NVIDIA driver is not "
                         "loaded (gpufleet lab: no nvidia in /etc/gpufleet-lab/modules)\n")
        return 1
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            route = self.path.split("?", 1)[0]
            if route == "/metrics":
                self.reply(200, dcgm_metrics(load_hw()).encode())
            elif route == "/health":
                self.reply(200, b"KO")  # sic: what dcgm-exporter 4.x answers
            elif route == "/":
                self.reply(200, DCGM_INDEX, "text/html; charset=utf-8")
            else:
                self.reply(404, b"404 page not found\n")

        def reply(self, code, body, ctype="text/plain; charset=utf-8"):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):  # the real one logs no scrapes
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    try:
        server = Server((host, int(port)), Handler)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"dcgm-exporter: failed to listen on {address}: {exc}\n")
        return 1
    sys.stderr.write(f"dcgm-exporter: {len(hw['gpus'])} GPU(s); serving /metrics on "
                     f"{address}\n")
    return run_daemon("dcgm-exporter", server.serve_forever)


TOOLS = {
    "nvidia-smi": nvidia_smi,
    "nvidia-ctk": nvidia_ctk,
    "nv-fabricmanager": nv_fabricmanager,
    "nvlsm": nvlsm,
    "nvidia-imex": nvidia_imex,
    "nvidia-imex-ctl": nvidia_imex_ctl,
    "dcgm-exporter": dcgm_exporter,
    "amd-smi": amd_smi,
    "rocm-smi": rocm_smi,
    "ibv_devinfo": ibv_devinfo,
    "ibstat": ibstat,
    "lsmod": lsmod,
    "modprobe": modprobe,
}


def main(tool, args):
    try:
        sys.stdout.flush()
        return TOOLS[tool](load_hw(), list(args)) or 0
    except BrokenPipeError:
        return 0

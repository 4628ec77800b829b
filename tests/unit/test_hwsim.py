"""The lab hardware simulator: render each profile, run its tools, parse them with the
same parser the roles use, so the simulator and the parser cannot drift apart."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from gpufleet.module_utils import gpu_facts as gf
from gpufleet_lab import hwsim

REAL_XML = Path(__file__).resolve().parents[1] / "fixtures/hardware/h200-1gpu/nvidia-smi-q.xml"
REAL_VM = Path(__file__).resolve().parents[1] / "fixtures/hardware/h200x2"


class Host:
    """A rendered lab host in a temporary directory."""

    def __init__(self, root: Path, profile: str, faults: list[str]):
        self.root = root
        self.files = hwsim.render(profile, faults, "lab1")
        for path, (content, mode) in self.files.items():
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(content)
            dest.chmod(mode)
        self.env = dict(os.environ, GPUFLEET_LAB_ROOT=str(root))
        self.procs: list[subprocess.Popen] = []
        # the device list's nodes, as names (mknod needs root): what find_nvswitches sees
        if "/etc/gpufleet-lab/devices" in self.files:
            for line in self.read("/etc/gpufleet-lab/devices").splitlines():
                if line.startswith("/dev/"):
                    node = root / line.split()[0].lstrip("/")
                    node.parent.mkdir(parents=True, exist_ok=True)
                    node.touch()

    def tool(self, name: str) -> Path:
        found = [p for p in self.files if p.endswith("/" + name)]
        assert found, f"{name} not rendered"
        return self.root / found[0].lstrip("/")

    def run(self, name: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(self.tool(name)), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    def out(self, name: str, *args: str) -> str:
        proc = self.run(name, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    def start(self, name: str, *args: str, pidfile: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(self.tool(name)), *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        pid = self.root / "run/gpufleet-lab" / pidfile
        deadline = time.monotonic() + 10
        while not pid.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc

    def read(self, path: str) -> str:
        return (self.root / path.lstrip("/")).read_text()

    def gpu_facts(self) -> dict:
        if "/usr/bin/nvidia-smi" not in self.files:
            rocm_version = self.read("/opt/rocm/.info/version")
            return gf.gpu_facts(
                amd_static=self.out("amd-smi", "static", "--json"), rocm_version=rocm_version
            )
        fm = (
            self.run("nv-fabricmanager", "--version").stdout
            if self.has("nv-fabricmanager")
            else None
        )
        return gf.gpu_facts(
            xml=self.out("nvidia-smi", "-q", "-x"),
            query=self.out(
                "nvidia-smi", "--query-gpu=index,uuid,name,compute_cap,memory.total", "--format=csv"
            ),
            topo=self.out("nvidia-smi", "topo", "-m"),
            nvlink=self.out("nvidia-smi", "nvlink", "-s"),
            proc_version=self.read("/etc/gpufleet-lab/proc/driver/nvidia/version"),
            fm_version=fm,
            nvswitches=gf.find_nvswitches(str(self.root / "dev"), str(self.root / "no-pci")),
        )

    def ib_facts(self) -> dict:
        devinfo = self.run("ibv_devinfo")
        return gf.ib_facts(devinfo.stdout, self.out("ibstat"), self.out("lsmod"))

    def has(self, name: str) -> bool:
        return any(p.endswith("/" + name) for p in self.files)


@pytest.fixture
def host(tmp_path):
    made: list[Host] = []

    def make(profile: str, *faults: str) -> Host:
        h = Host(tmp_path / f"host{len(made)}", profile, list(faults))
        made.append(h)
        return h

    yield make
    for h in made:
        for proc in h.procs:
            proc.terminate()
            proc.wait(timeout=10)


EXPECTED = {
    "h200x8": ("NVIDIA H200", 8, "hopper", "9.0", 143771),
    "h200x2": ("NVIDIA H200", 2, "hopper", "9.0", 143771),
    "b200x8": ("NVIDIA B200", 8, "blackwell", "10.0", 183359),
    "b300x8": ("NVIDIA B300 SXM6 AC", 8, "blackwell", "10.3", 275040),
    "gb200x4": ("NVIDIA GB200", 4, "blackwell", "10.0", 189471),
    "gb300x4": ("NVIDIA GB300", 4, "blackwell", "10.3", 284208),
    "mi300x8": ("AMD Instinct MI300X", 8, "cdna3", "gfx942", 196592),
    "mi325x8": ("AMD Instinct MI325X", 8, "cdna3", "gfx942", 262144),
    "mi355x8": ("AMD Instinct MI355X", 8, "cdna4", "gfx950", 294896),
}
# HCAs per host: one per GPU (a GB300 tray's ConnectX-8 ports run InfiniBand XDR, one each)
HCAS = {"gb200x4": 4, "gb300x4": 4}


def test_every_profile_is_expected():
    assert set(hwsim.PROFILES) == set(EXPECTED)


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_profile_parses_to_its_hardware(host, profile):
    name, count, arch, target, memory = EXPECTED[profile]
    h = host(profile)
    facts = h.gpu_facts()
    assert (facts["model"], facts["count"], facts["arch"], facts["memory_mib"]) == (
        name,
        count,
        arch,
        memory,
    )
    assert target in (facts["compute_capability"], facts["gfx_target"])
    assert len({g["uuid"] if "uuid" in g else g["bus_id"] for g in facts["gpus"]}) == count
    ib = h.ib_facts()
    devices = h.read("/etc/gpufleet-lab/devices")
    assert ib["peermem_loaded"] is False
    if profile == "h200x2":  # the virtual machine has no HCA
        assert (ib["count"], ib["all_active"]) == (0, False)
        assert "/dev/infiniband" not in devices
    else:
        assert ib["count"] == HCAS.get(profile, 8)
        assert ib["all_active"] is True
        assert ib["link_layers"] == ["InfiniBand"]
        assert "/dev/infiniband/uverbs0 231 192" in devices
    if facts["vendor"] == "nvidia":
        assert facts["driver_version"] == "580.159.04"
        assert facts["cuda_version"] == "13.0"
        assert facts["kernel_module"]["version"] == "580.159.04"
        assert facts["topology"]["gpu_link"] == "NV18"
        assert facts["nvlink"]["active_links_per_gpu"] == [18] * count
        assert f"/dev/nvidia{count - 1} 195 {count - 1}" in devices
        assert "/dev/nvidiactl 195 255" in devices
    else:
        assert facts["rocm_version"] == "7.0.2"
        assert "/dev/kfd" in devices and "/dev/dri/renderD135 226 135" in devices


def test_h200x8_xml_is_the_real_capture_repeated(host):
    """Every simulated <gpu> has exactly the elements of the real H200's <gpu>."""

    def paths(gpu):
        out = set()

        def walk(node, prefix):
            for child in node:
                here = f"{prefix}/{child.tag}"
                out.add(here)
                walk(child, here)

        walk(gpu, "")
        return out

    real = paths(ET.parse(REAL_XML).getroot().find("gpu"))
    root = ET.fromstring(host("h200x8").out("nvidia-smi", "-q", "-x"))
    gpus = root.findall("gpu")
    assert len(gpus) == 8
    assert all(paths(g) == real for g in gpus)
    assert [g.findtext("minor_number") for g in gpus] == [str(i) for i in range(8)]
    assert len({g.get("id") for g in gpus}) == 8
    assert root.findtext("attached_gpus") == "8"


def test_h200x8_topology_nv18_between_all_gpu_pairs_and_nic_legend(host):
    topo = gf.parse_topo(host("h200x8").out("nvidia-smi", "topo", "-m"))
    gpus = [f"GPU{i}" for i in range(8)]
    assert topo["gpus"] == gpus
    assert all(topo["matrix"][a][b] == "NV18" for a in gpus for b in gpus if a != b)
    assert topo["nics"] == [f"mlx5_{i}" for i in range(8)]
    assert topo["matrix"]["GPU3"]["mlx5_3"] == "PIX"
    assert topo["matrix"]["GPU0"]["mlx5_7"] == "SYS"


def test_unknown_profile_names_the_valid_ones():
    with pytest.raises(ValueError, match="h200x8.*b200x8.*gb200x4.*mi355x8"):
        hwsim.render("h100x8", [], "lab1")


def test_faults_are_validated_and_other_labs_faults_ignored():
    for name in (
        "fm-mismatch",
        "driver-old",
        "gpu-missing",
        "no-ib",
        "ib-down",
        "peermem-missing",
        "imex-down",
        "fabric-pending",
        "disk-small",
        "flashinfer-old",
        "flashinfer-split",
    ):
        assert name in hwsim.FAULTS
    with pytest.raises(ValueError, match="fm-mismach"):
        hwsim.render("h200x8", ["fm-mismach"], "lab1")
    plain = hwsim.render("h200x8", [], "lab1")
    other = hwsim.render("h200x8", ["disk-small", "flashinfer-old"], "lab1")
    assert set(plain) == set(other)
    assert [p for p in plain if plain[p] != other[p]] == ["/etc/gpufleet-lab/hw.json"]


def test_rendered_tools_are_executable_python_scripts():
    files = hwsim.render("gb200x4", [], "lab1")
    for path in (
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-imex-ctl",
        "/usr/sbin/ibstat",
        "/usr/local/sbin/modprobe",
    ):
        content, mode = files[path]
        assert content.startswith(b"#!/usr/bin/python3\n")
        assert mode == 0o755


@pytest.mark.parametrize("profile", ["b200x8", "b300x8"])
def test_fabric_manager_brings_the_fabric_to_completed(host, profile):
    h = host(profile)
    assert h.gpu_facts()["fabric"]["state"] == "In Progress"
    h.start(
        "nv-fabricmanager",
        "-c",
        "/usr/share/nvidia/nvswitch/fabricmanager.cfg",
        pidfile="nv-fabricmanager.pid",
    )
    facts = h.gpu_facts()
    assert facts["fabric"]["state"] == "Completed"
    assert facts["fabric"]["completed"] is True
    assert facts["fabric_manager_matches_driver"] is True
    assert h.out("nvlsm", "--version").startswith("nvlsm version")


def test_hgx_hosts_own_their_nvswitches_and_run_the_fabric_manager(host):
    for profile, switches in (("h200x8", 4), ("b200x8", 2), ("b300x8", 2)):
        h = host(profile)
        facts = h.gpu_facts()
        assert facts["nvswitches"] == [
            str(h.root / f"dev/nvidia-nvswitch{i}") for i in range(switches)
        ]
        assert facts["fabric_manager"] == "local"
        assert "/dev/nvidia-nvswitchctl 509 255" in h.read("/etc/gpufleet-lab/devices")
    # a GB200 / GB300 tray's fabric belongs to the NVLink switch trays
    for tray in ("gb200x4", "gb300x4"):
        assert host(tray).gpu_facts()["fabric_manager"] == "external"


def test_h200x2_is_the_real_2x_h200_virtual_machine(host):
    """Same XML elements, topology and links as the real VM; fabric up, run by the hypervisor."""
    h = host("h200x2")

    def paths(gpu):
        return {e.tag for e in gpu.iter()}

    real = ET.parse(REAL_VM / "nvidia-smi-q.xml").getroot().findall("gpu")
    sim = ET.fromstring(h.out("nvidia-smi", "-q", "-x")).findall("gpu")
    assert [g.get("id") for g in sim] == [g.get("id") for g in real]
    assert [paths(g) for g in sim] == [paths(g) for g in real]
    for tag in (
        "fabric/state",
        "fabric/status",
        "fabric/cliqueId",
        "fabric/clusterUuid",
        "fabric/health/summary",
        "product_name",
        "vbios_version",
        "fb_memory_usage/total",
    ):
        assert [g.findtext(tag) for g in sim] == [g.findtext(tag) for g in real], tag
    assert gf.parse_topo(h.out("nvidia-smi", "topo", "-m")) == gf.parse_topo(
        (REAL_VM / "topo.txt").read_text()
    )
    real_links = gf.parse_nvlink_status((REAL_VM / "nvlink-s.txt").read_text())
    sim_links = gf.parse_nvlink_status(h.out("nvidia-smi", "nvlink", "-s"))
    assert [g["links"] for g in sim_links] == [g["links"] for g in real_links]
    assert not h.has("nv-fabricmanager")
    assert "/lib/systemd/system/nvidia-fabricmanager.service" not in h.files
    assert "nvswitch" not in h.read("/etc/gpufleet-lab/devices")
    facts = h.gpu_facts()
    assert (facts["fabric"]["ok"], facts["nvswitches"]) == (True, [])
    assert facts["fabric_manager"] == "external"
    assert facts["fabric_problem"] is None


@pytest.mark.parametrize("profile, pci, watts", [
    ("b300x8", ("318210DE", "20E610DE"), "1100.00 W"),
    ("gb300x4", ("31C210DE", "21F110DE"), "1400.00 W"),
])
def test_blackwell_ultra_reports_its_pci_ids_power_nvlink_and_connectx8(host, profile, pci,
                                                                        watts):
    h = host(profile)
    gpus = ET.fromstring(h.out("nvidia-smi", "-q", "-x")).findall("gpu")
    assert {(g.findtext("pci/pci_device_id"), g.findtext("pci/pci_sub_system_id"))
            for g in gpus} == {pci}
    assert {g.findtext("gpu_power_readings/current_power_limit") for g in gpus} == {watts}
    assert {g.findtext("product_architecture") for g in gpus} == {"Blackwell"}
    query = h.out("nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader")
    assert set(query.split()) == {"10.3"}
    links = gf.parse_nvlink_status(h.out("nvidia-smi", "nvlink", "-s"))
    assert {x["speed_gbps"] for g in links for x in g["links"]} == {53.125}  # NVLink 5, as printed
    hcas = gf.parse_ibstat(h.out("ibstat"))
    assert {(c["ca_type"], c["ports"][0]["rate_gbps"]) for c in hcas} == {("MT4131", 800)}
    assert h.read("/etc/gpufleet-lab/sys/class/infiniband/mlx5_0/ports/1/rate") == (
        "800 Gb/sec (4X XDR)\n")


@pytest.mark.parametrize("profile, ids, units, vram", [
    ("mi300x8", ("0x74a1", "0x74a1"), 304, "HBM3"),
    ("mi325x8", ("0x74a5", "0x0c34"), 304, "HBM3E"),
])
def test_cdna3_reports_its_pci_ids_compute_units_and_vram(host, profile, ids, units, vram):
    static = json.loads(host(profile).out("amd-smi", "static", "--json"))["gpu_data"]
    assert {(g["asic"]["device_id"], g["asic"]["subsystem_id"]) for g in static} == {ids}
    assert {(g["asic"]["num_compute_units"], g["asic"]["target_graphics_version"],
             g["vram"]["type"]) for g in static} == {(units, "gfx942", vram)}


def test_fault_fabric_pending_on_the_vm(host):
    facts = host("h200x2", "fabric-pending").gpu_facts()
    assert (facts["fabric"]["state"], facts["fabric"]["status"]) == ("In Progress", None)
    assert facts["fabric_manager"] == "external"
    assert "Fabric State In Progress, Status N/A" in facts["fabric_problem"]


def test_fault_fm_mismatch(host):
    h = host("h200x8", "fm-mismatch")
    facts = h.gpu_facts()
    assert facts["fabric_manager_version"] == "580.126.09"
    assert facts["driver_version"] == "580.159.04"
    assert facts["fabric_manager_matches_driver"] is False
    proc = h.run("nv-fabricmanager", "-c", "/usr/share/nvidia/nvswitch/fabricmanager.cfg")
    assert proc.returncode == 1
    assert "don't match with driver version 580.159.04" in proc.stderr
    assert h.gpu_facts()["fabric"]["state"] == "In Progress"


def test_fault_driver_old(host):
    facts = host("h200x8", "driver-old").gpu_facts()
    assert facts["driver_version"].startswith("535.")
    assert facts["kernel_module"]["version"] == facts["driver_version"]
    assert facts["cuda_version"] == "12.2"
    assert facts["fabric_manager_version"] == facts["driver_version"]


def test_fault_gpu_missing(host):
    facts = host("h200x8", "gpu-missing").gpu_facts()
    assert facts["count"] == 7
    assert len(facts["topology"]["gpus"]) == 7


def test_fault_no_ib(host):
    h = host("h200x8", "no-ib")
    proc = h.run("ibv_devinfo")
    assert proc.returncode != 0 and "No IB devices found" in proc.stderr
    ib = h.ib_facts()
    assert ib["present"] is False
    assert h.gpu_facts()["topology"]["nics"] == []
    assert "/dev/infiniband" not in h.read("/etc/gpufleet-lab/devices")


def test_fault_ib_down(host):
    ib = host("h200x8", "ib-down").ib_facts()
    assert ib["present"] is True
    assert ib["active"] == []
    assert {p["state"] for h in ib["hcas"] for p in h["ports"]} == {"Down"}


def test_modprobe_peermem_loads_and_fault_fails_with_the_real_error(host):
    good = host("h200x8")
    assert good.run("modprobe", "nvidia_peermem").returncode == 0
    assert good.ib_facts()["peermem_loaded"] is True
    assert "nvidia_peermem" in good.read("/etc/gpufleet-lab/modules")
    bad = host("h200x8", "peermem-missing")
    proc = bad.run("modprobe", "nvidia-peermem")
    assert proc.returncode == 1
    assert "disagrees about version of symbol ib_register_peer_memory_client" in proc.stderr
    assert "could not insert 'nvidia_peermem'" in proc.stderr
    assert bad.ib_facts()["peermem_loaded"] is False


def test_nvidia_smi_fails_like_the_real_one_without_the_driver(host):
    h = host("h200x8")
    assert h.run("modprobe", "-r", "nvidia").returncode == 0
    proc = h.run("nvidia-smi")
    assert proc.returncode == 9
    assert "couldn't communicate with the NVIDIA driver" in proc.stdout


def test_query_gpu_rejects_unknown_fields_and_honours_nounits(host):
    h = host("h200x8")
    assert h.run("nvidia-smi", "--query-gpu=bogus", "--format=csv").returncode == 2
    out = h.out("nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits")
    assert out.splitlines() == ["143771"] * 8


def test_persistence_mode_is_set_by_pm_1(host):
    h = host("h200x8")
    assert h.gpu_facts()["persistence_mode"] is False
    assert "All done." in h.out("nvidia-smi", "-pm", "1")
    assert h.gpu_facts()["persistence_mode"] is True


def _imex_nodes(h: Host, *nodes: str, port: int) -> None:
    cfg = h.root / "etc/nvidia-imex/config.cfg"
    cfg.write_text(re.sub(r"SERVER_PORT=\d+", f"SERVER_PORT={port}", cfg.read_text()))
    (h.root / "etc/nvidia-imex/nodes_config.cfg").write_text("".join(n + "\n" for n in nodes))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("profile", ["gb200x4", "gb300x4"])
def test_grace_tray_imex_domain_up_and_mnnvl_facts(host, profile):
    h = host(profile)
    hw = h.read("/etc/gpufleet-lab/hw.json")
    assert '"cpu_arch": "aarch64"' in hw
    assert "for aarch64" in h.read("/etc/gpufleet-lab/proc-driver-nvidia-version")
    assert "/dev/nvidia-caps-imex-channels/channel0" in h.read("/etc/gpufleet-lab/devices")
    facts = h.gpu_facts()
    assert facts["fabric"]["state"] == "Completed"
    assert facts["fabric"]["cluster_uuid"] == {
        "gb200x4": "5d2c0a8e-6f4b-4c1e-9a37-2b8d1e0f7c41",
        "gb300x4": "019a7368-bea6-45df-8160-88df2f44dc0a"}[profile]  # one domain per kind
    assert facts["fabric"]["clique_id"] == "32766"
    assert h.run("nvidia-imex", "-c", "/etc/nvidia-imex/config.cfg").returncode == 1  # no nodes
    _imex_nodes(h, "127.0.0.1", "127.0.0.2", port=_free_port())
    assert h.run("nvidia-imex-ctl", "-N").returncode == 1  # service not running yet
    h.start("nvidia-imex", "-c", "/etc/nvidia-imex/config.cfg", pidfile="nvidia-imex.pid")
    imex = gf.parse_imex_status(h.out("nvidia-imex-ctl", "-N"))
    assert imex["domain_state"] == "UP"
    assert imex["all_connected"] is True
    assert [n["version"] for n in imex["nodes"]] == ["580.159.04"] * 2


def test_gb200_imex_peer_not_running_is_down(host):
    h = host("gb200x4")
    _imex_nodes(h, "127.0.0.1", "192.0.2.1", port=_free_port())  # TEST-NET: nobody there
    h.start("nvidia-imex", "-c", "/etc/nvidia-imex/config.cfg", pidfile="nvidia-imex.pid")
    imex = gf.parse_imex_status(h.out("nvidia-imex-ctl", "-N"))
    assert imex["domain_state"] == "DOWN"
    assert [n["state"] for n in imex["nodes"]] == ["READY", "UNAVAILABLE"]


def test_fault_imex_down(host):
    h = host("gb200x4", "imex-down")
    _imex_nodes(h, "127.0.0.1", "127.0.0.2", port=_free_port())
    h.start("nvidia-imex", "-c", "/etc/nvidia-imex/config.cfg", pidfile="nvidia-imex.pid")
    imex = gf.parse_imex_status(h.out("nvidia-imex-ctl", "-N"))
    assert imex["domain_state"] == "DOWN"
    assert imex["all_connected"] is False


@pytest.mark.parametrize("profile", ["mi300x8", "mi325x8", "mi355x8"])
def test_rocm_smi_agrees_with_amd_smi(host, profile):
    h = host(profile)
    out = h.out("rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json")
    facts = gf.gpu_facts(rocm_smi=out)
    _, count, _, gfx, memory = EXPECTED[profile]
    assert (facts["count"], facts["gfx_target"], facts["memory_mib"]) == (count, gfx, memory)
    amd_smi = h.gpu_facts()
    for key in ("count", "model", "arch", "gfx_target", "memory_mib"):
        assert facts[key] == amd_smi[key], key
    assert not h.has("nvidia-smi")


def test_mi355x8_amd_smi_health_commands_answer_in_the_real_json_shape(host):
    """metric -e -k -t and xgmi -l as amd-smi 26.x writes them (the health checker reads
    them): {"gpu_data": [...]} of ecc, ecc_blocks and temperature; {"link_status": [...]}."""
    h = host("mi355x8")
    metric = json.loads(h.out("amd-smi", "metric", "-e", "-k", "-t", "--json"))["gpu_data"]
    assert [m["gpu"] for m in metric] == list(range(8))
    assert set(metric[0]) == {"gpu", "temperature", "ecc", "ecc_blocks"}
    assert metric[0]["temperature"]["hotspot"] == {"value": 41, "unit": "C"}
    assert metric[0]["ecc"]["total_uncorrectable_count"] == 0
    assert metric[0]["ecc_blocks"]["UMC"] == {
        "correctable_count": 0, "uncorrectable_count": 0, "deferred_count": 0}
    only_temp = json.loads(h.out("amd-smi", "metric", "--temperature", "--json"))["gpu_data"]
    assert set(only_temp[0]) == {"gpu", "temperature"}
    xgmi = json.loads(h.out("amd-smi", "xgmi", "--link-status", "--json"))["link_status"]
    assert xgmi[1] == {"gpu": 1, "bdf": "0000:15:00.0",
                       "link_status": ["U", "SELF", "U", "U", "U", "U", "U", "U"]}
    static = json.loads(h.out("amd-smi", "static", "--json"))["gpu_data"]
    assert static[0]["ras"]["ecc_block_state"]["UMC"] == "ENABLED"


def test_nvidia_ctk_generates_a_cdi_spec_of_the_gpus_and_lists_its_devices(host):
    h = host("h200x8")
    spec = h.out("nvidia-ctk", "cdi", "generate")
    spec_doc = yaml.safe_load(spec)
    assert spec_doc["cdiVersion"] == "0.5.0" and spec_doc["kind"] == "nvidia.com/gpu"
    names = [d["name"] for d in spec_doc["devices"]]
    assert names == [str(i) for i in range(8)] + ["all"]
    everything = spec_doc["devices"][-1]["containerEdits"]["deviceNodes"]
    devices = h.read("/etc/gpufleet-lab/devices")
    for node in everything + spec_doc["containerEdits"]["deviceNodes"]:
        assert f"{node['path']} " in devices  # every node exists on the host
    assert h.out("nvidia-ctk", "cdi", "list") == ""  # nothing installed yet
    assert h.run("nvidia-ctk", "cdi", "generate", "--output=/etc/cdi/nvidia.yaml").returncode == 0
    listed = h.out("nvidia-ctk", "cdi", "list").split()
    assert listed == [f"nvidia.com/gpu={n}" for n in names]
    assert h.out("nvidia-ctk", "--version").startswith("NVIDIA Container Toolkit CLI version")


def test_nvidia_ctk_needs_the_driver_as_the_real_one_does(host):
    h = host("h200x8")
    assert h.run("modprobe", "-r", "nvidia").returncode == 0
    proc = h.run("nvidia-ctk", "cdi", "generate")
    assert proc.returncode == 1 and "failed to initialize NVML" in proc.stderr


@pytest.mark.parametrize("profile", ["mi300x8", "mi325x8", "mi355x8", "h200x8", "b300x8",
                                     "gb300x4"])
def test_containers_see_the_simulated_gpus_on_amd_hosts_only(profile):
    """AMD: a containers.conf drop-in mounts the simulated hardware into every container
    (a ROCm container reads the host's sysfs); NVIDIA hosts get it from the CDI spec, and a
    second mount of the same path would make podman refuse the container."""
    files = hwsim.render(profile, [], "lab1")
    conf = files.get(hwsim.AMD_CONTAINERS_CONF)
    if profile.startswith("mi"):
        volumes = tomllib.loads(conf[0].decode())["containers"]["volumes"]
        assert volumes == [f"{hwsim.LAB}:{hwsim.LAB}:ro", f"{hwsim.LIB}:{hwsim.LIB}:ro"]
        assert any(p == "/dev/kfd" for p, _, _ in hwsim.devices(
            hwsim.build_hw(profile, [], "lab1")))
    else:
        assert conf is None


# ---------------------------------------------------------------- dcgm-exporter

# The default counters the site's dashboards and alerts read, with dcgm-exporter 4.x's HELP
# texts and types (etc/default-counters.csv)
DCGM_REQUIRED = {
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_MEM_CLOCK": ("gauge", "Memory clock frequency (in MHz)."),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (
        "counter", "Total energy consumption since boot (in mJ)."),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "Total number of PCIe retries."),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gauge", "Memory utilization (in %)."),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered."),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Framebuffer memory free (in MiB)."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
}
DCGM_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
               "DCGM_FI_DRIVER_VERSION"]
PROM_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)")
PROM_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"(?:,|$)')


def parse_prometheus(text: str) -> dict:
    """A strict reader of the Prometheus text format (prometheus_client is not in the
    venv): each family's HELP, then its TYPE, then its samples; labels in their order;
    float values; no family or series twice; nothing else."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current: dict | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP "):].partition(" ")
            assert name not in families, f"{name}: HELP twice"
            current = families[name] = {"help": help_text, "type": None, "samples": []}
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            assert current is not None and current is families.get(name), line
            assert current["type"] is None and not current["samples"], line
            assert kind in ("gauge", "counter"), line
            current["type"] = kind
        else:
            m = PROM_SAMPLE.fullmatch(line)
            assert m, f"not a sample: {line!r}"
            name, body, value = m.groups()
            assert current is not None and current is families.get(name), line
            assert current["type"], f"{name}: a sample before its TYPE"
            labels, pos = [], 0
            while pos < len(body):
                lm = PROM_LABEL.match(body, pos)
                assert lm, f"bad labels at {body[pos:]!r}"
                labels.append((lm.group(1), lm.group(2)))
                pos = lm.end()
            assert labels not in [s[0] for s in current["samples"]], f"{name}: series twice"
            current["samples"].append((labels, float(value), value))
    return families


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fake_journal(h: Host, tmp_path: Path) -> Path:
    """A journalctl first on the exporter's PATH: this boot's kernel messages (-k, JSON,
    MESSAGE only) are the lines of the returned file, which a test appends to."""
    bindir, messages = tmp_path / "fakebin", tmp_path / "kernel.jsonl"
    bindir.mkdir(exist_ok=True)
    messages.write_text("")
    tool = bindir / "journalctl"
    tool.write_text('#!/bin/sh\n[ "$*" = "-k -o json --output-fields=MESSAGE -q --no-pager" ] '
                    f'|| {{ echo "unexpected: $*" >&2; exit 3; }}\ncat {messages}\n')
    tool.chmod(0o755)
    h.env["PATH"] = f"{bindir}:{h.env['PATH']}"
    h.env.pop("NODE_NAME", None)
    return messages


def kernel_entry(message: str) -> str:
    return json.dumps({"MESSAGE": message}) + "\n"


def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


@pytest.mark.parametrize("profile,faults", [("h200x8", ()), ("gb300x4", ()), ("h200x2", ()),
                                            ("b200x8", ("gpu-missing",))])
def test_dcgm_exporter_serves_the_default_counters_per_gpu(host, tmp_path, profile, faults):
    h = host(profile, *faults)
    messages = fake_journal(h, tmp_path)
    port = free_port()
    proc = h.start("dcgm-exporter", "-a", f"127.0.0.1:{port}", pidfile="dcgm-exporter.pid")
    assert proc.poll() is None, proc.stderr.read()
    query = h.out("nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,name,memory.total,"
                  "memory.free,driver_version", "--format=csv,noheader,nounits")
    gpus = [dict(zip(("index", "uuid", "bus_id", "name", "total", "free", "driver"),
                     row.split(", "), strict=True)) for row in query.splitlines()]

    ctype, text = scrape(port)
    assert ctype.startswith("text/plain")
    families = parse_prometheus(text)
    for name, (kind, help_text) in DCGM_REQUIRED.items():
        assert (families[name]["type"], families[name]["help"]) == (kind, help_text), name
    for name, family in families.items():
        assert name.startswith(("DCGM_FI_DEV_", "DCGM_FI_PROF_")), name
        assert [dict(s[0])["gpu"] for s in family["samples"]] == [g["index"] for g in gpus]
        for (labels, _, _), g in zip(family["samples"], gpus, strict=True):
            assert [k for k, _ in labels] == DCGM_LABELS, name
            assert dict(labels) == {
                "gpu": g["index"], "UUID": g["uuid"], "pci_bus_id": g["bus_id"],
                "device": f"nvidia{g['index']}", "modelName": g["name"],
                "Hostname": socket.gethostname(), "DCGM_FI_DRIVER_VERSION": g["driver"]}

    def values(name, fams):
        return [s[1] for s in fams[name]["samples"]]

    used, free = values("DCGM_FI_DEV_FB_USED", families), values("DCGM_FI_DEV_FB_FREE", families)
    assert [u + f for u, f in zip(used, free, strict=True)] == [float(g["total"]) for g in gpus]
    assert free == [float(g["free"]) for g in gpus]  # what nvidia-smi calls free
    assert values("DCGM_FI_DEV_XID_ERRORS", families) == [0.0] * len(gpus)
    assert values("DCGM_FI_DEV_GPU_UTIL", families) == [0.0] * len(gpus)
    assert all(30 < t < 90 for t in values("DCGM_FI_DEV_GPU_TEMP", families))
    power = [s[2] for s in families["DCGM_FI_DEV_POWER_USAGE"]["samples"]]
    assert all(re.fullmatch(r"\d+\.\d{6}", p) for p in power)  # a DCGM double: %f

    # Xids land in the kernel log while it runs: the last one per GPU, by PCI address
    second = gpus[1]["bus_id"].split(":")
    xid_pci = f"PCI:{second[0][-4:]}:{second[1]}:{second[2].split('.')[0]}"
    with messages.open("a") as f:
        f.write(kernel_entry(f"NVRM: Xid ({xid_pci}): 48, pid=1234, name=python3, An "
                             "uncorrectable double bit error (DBE) has been detected"))
        f.write(kernel_entry("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, link 7"))
        f.write(kernel_entry(f"NVRM: Xid ({xid_pci.lower()}): 79, pid='<unknown>', "
                             "name=<unknown>, GPU has fallen off the bus."))
        f.write(kernel_entry("NVRM: Xid (PCI:0000:ee:00): 13, pid=1, not a GPU of this host"))
        # a message that is not UTF-8 comes as an array of bytes
        f.write(json.dumps({"MESSAGE": list(b"NVRM: \xff garbage")}) + "\n")
    later = parse_prometheus(scrape(port)[1])
    assert values("DCGM_FI_DEV_XID_ERRORS", later) == [0.0, 79.0] + [0.0] * (len(gpus) - 2)
    energy = values("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", families)
    assert all(b >= a > 0 for a, b in
               zip(energy, values("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", later),
                   strict=True))

    proc.terminate()
    assert proc.wait(timeout=10) == 0
    assert not (h.root / "run/gpufleet-lab/dcgm-exporter.pid").exists()


def test_dcgm_exporter_listens_on_every_address_and_answers_like_the_real_one(host, tmp_path):
    """`:PORT` (the default is `:9400`) listens on 0.0.0.0; DCGM_EXPORTER_LISTEN sets it as
    the real flag's environment variable does."""
    h = host("h200x8")
    fake_journal(h, tmp_path)
    port = free_port("0.0.0.0")
    h.env["DCGM_EXPORTER_LISTEN"] = f":{port}"
    proc = h.start("dcgm-exporter", pidfile="dcgm-exporter.pid")
    assert proc.poll() is None, proc.stderr.read()
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    assert [f"00000000:{port:04X}", "0A"] in [[c[1], c[3]] for c in listening]
    assert "GPU Exporter" in scrape(port, "/")[1]
    with pytest.raises(urllib.error.HTTPError) as err:
        scrape(port, "/nothing")
    assert err.value.code == 404
    # a second one on the same port fails, as the real one does
    again = h.run("dcgm-exporter", "-a", f":{port}")
    assert again.returncode == 1 and "failed to listen" in again.stderr


def test_dcgm_exporter_needs_the_driver_and_rejects_unknown_flags(host):
    h = host("h200x8")
    bad = h.run("dcgm-exporter", "--nonsense")
    assert bad.returncode == 1 and "flag provided but not defined" in bad.stderr
    assert h.run("modprobe", "-r", "nvidia").returncode == 0
    proc = h.run("dcgm-exporter", "-a", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1 and "driver is not loaded" in proc.stderr


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_dcgm_exporter_is_on_nvidia_hosts_only_enabled_at_boot(profile):
    """The site's dcgm-exporter: its program and a unit under /etc/systemd/system (which the
    lab enables by its WantedBy=, hosts.prepare_host), on NVIDIA hosts; none on AMD."""
    files = hwsim.render(profile, [], "lab1")
    unit = files.get("/etc/systemd/system/dcgm-exporter.service")
    if profile.startswith("mi"):
        assert unit is None
        assert not [p for p in files if "dcgm" in p]
        return
    content, mode = files["/usr/bin/dcgm-exporter"]
    assert content.startswith(b"#!/usr/bin/python3\n") and mode == 0o755
    assert b"hwlab.main('dcgm-exporter'" in content
    text = unit[0].decode()
    assert "\nExecStart=/usr/bin/dcgm-exporter\n" in text  # the default address
    assert b'DCGM_LISTEN = ":9400"' in files["/usr/lib/gpufleet-lab/hwlab.py"][0]
    for line in ("Type=simple", "Restart=on-failure", "[Install]\nWantedBy=multi-user.target"):
        assert f"\n{line}\n" in text

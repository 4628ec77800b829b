"""The one GPU/RDMA parser, on real captures and on the formats the tools print."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.module_utils import gpu_facts as gf

REPO = Path(__file__).resolve().parents[2]
H200 = REPO / "tests/fixtures/hardware/h200-1gpu"
DEVICE = REPO / "tests/fixtures/hardware/h200-1gpu-preflight"


def host_facts_section(start: str) -> str:
    text = (H200 / "host-facts.txt").read_text()
    return text[text.index(start) :].split("\n\n")[0]


@pytest.fixture(scope="module")
def real():
    return gf.gpu_facts(
        xml=(H200 / "nvidia-smi-q.xml").read_text(),
        topo=(H200 / "topo.txt").read_text(),
        query=host_facts_section("index, name"),
        proc_version=host_facts_section("NVRM version"),
    )


def test_real_h200_capture(real):
    assert real["present"] is True
    assert real["vendor"] == "nvidia"
    assert real["count"] == 1
    assert real["model"] == "NVIDIA H200"
    assert real["arch"] == "hopper"
    assert real["compute_capability"] == "9.0"
    assert real["memory_mib"] == 143771
    assert real["driver_version"] == "580.159.04"
    assert real["cuda_version"] == "13.0"
    assert real["persistence_mode"] is True
    assert real["ecc_mode"] is True
    assert real["mig_mode"] is False
    assert real["ecc_errors"] == {"volatile_uncorrectable": 0, "aggregate_uncorrectable": 0}
    assert real["kernel_module"] == {
        "version": "580.159.04",
        "kernel_module": "open",
        "arch": "x86_64",
    }


def test_real_capture_per_gpu_and_fabric_na(real):
    gpu = real["gpus"][0]
    assert gpu["uuid"] == "GPU-7cd4538c-cfa4-fc50-987a-5a01ed9ef339"
    assert gpu["bus_id"] == "00000000:00:06.0"
    assert gpu["minor_number"] == 0
    assert gpu["power_limit_w"] == 700.0
    # A single PCIe-attached H200 in a VM: every <fabric> value is N/A.
    assert gpu["fabric"] == {
        "state": None,
        "status": None,
        "clique_id": None,
        "cluster_uuid": None,
        "health": None,
    }
    assert real["fabric"]["supported"] is False
    assert real["fabric"]["completed"] is False


def test_real_topology_single_gpu(real):
    topo = real["topology"]
    assert topo["gpus"] == ["GPU0"]
    assert topo["nics"] == []
    assert topo["affinity"]["GPU0"] == {"cpu": "0-15", "numa": "0"}
    assert topo["gpu_link"] is None


def test_compute_capability_without_query_comes_from_the_model():
    facts = gf.gpu_facts(xml=(H200 / "nvidia-smi-q.xml").read_text())
    assert facts["compute_capability"] == "9.0"
    assert facts["arch"] == "hopper"


def test_query_gpu_with_header_units_and_noheader():
    rows = gf.parse_query_gpu(host_facts_section("index, name"))
    assert rows[0]["memory.total"] == "143771 MiB"
    assert gf.to_int(rows[0]["memory.total"]) == 143771
    assert rows[0]["compute_cap"] == "9.0"
    bare = gf.parse_query_gpu("0, NVIDIA H200, [N/A]\n", fields=["index", "name", "serial"])
    assert bare == [{"index": "0", "name": "NVIDIA H200", "serial": None}]


def test_missing_and_not_available_fields_become_none():
    xml = """<?xml version="1.0" ?>
<nvidia_smi_log>
  <driver_version>535.274.02</driver_version>
  <attached_gpus>1</attached_gpus>
  <gpu id="00000000:18:00.0">
    <product_name>NVIDIA H100 80GB HBM3</product_name>
    <persistence_mode>[N/A]</persistence_mode>
    <ecc_mode><current_ecc>Not Supported</current_ecc></ecc_mode>
    <fb_memory_usage><total>81559 MiB</total></fb_memory_usage>
  </gpu>
</nvidia_smi_log>"""
    facts = gf.gpu_facts(xml=xml)
    gpu = facts["gpus"][0]
    assert gpu["persistence_mode"] is None
    assert gpu["ecc_mode"] is None
    assert gpu["mig_mode"] is None
    assert gpu["uuid"] is None
    assert gpu["fabric"]["state"] is None
    assert facts["cuda_version"] is None
    assert facts["memory_mib"] == 81559
    assert facts["arch"] == "hopper"
    assert facts["persistence_mode"] is False


def test_old_driver_ecc_layout_counts_double_bit_as_uncorrectable():
    xml = """<nvidia_smi_log><gpu id="0"><product_name>NVIDIA A100</product_name>
    <ecc_errors><volatile>
      <single_bit><device_memory>3</device_memory><total>3</total></single_bit>
      <double_bit><device_memory>2</device_memory><register_file>N/A</register_file>
      <total>2</total></double_bit>
    </volatile></ecc_errors></gpu></nvidia_smi_log>"""
    gpu = gf.parse_nvidia_smi_xml(xml)["gpus"][0]
    assert gpu["ecc_errors"]["volatile"] == {"correctable": 6, "uncorrectable": 4}


def test_nvlink_status_with_inactive_links():
    text = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-abc)\n"
        "\t Link 0: 26.562 GB/s\n\t Link 1: <inactive>\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-def)\n\t Link 0: 26.562 GB/s\n"
    )
    facts = gf.gpu_facts(xml=(H200 / "nvidia-smi-q.xml").read_text(), nvlink=text)
    assert facts["nvlink"]["active_links_per_gpu"] == [1, 1]
    assert facts["nvlink"]["inactive_links"] == 1
    assert facts["nvlink"]["gpus"][0]["links"][0]["speed_gbps"] == 26.562


def test_proprietary_aarch64_proc_version():
    text = "NVRM version: NVIDIA UNIX aarch64 Kernel Module  570.172.08  Tue Jul  8 2025\n"
    assert gf.parse_proc_driver_version(text) == {
        "version": "570.172.08",
        "kernel_module": "proprietary",
        "arch": "aarch64",
    }


AMD_ENTRY = {
    "gpu": 0,
    "asic": {"market_name": "AMD Instinct MI300X", "target_graphics_version": "gfx942"},
    "bus": {"bdf": "0000:83:00.0"},
    "vram": {"type": "HBM3", "size": {"value": 196592, "unit": "MB"}},
    "driver": {"name": "amdgpu", "version": "6.12.12"},
}


@pytest.mark.parametrize(
    "payload", [[AMD_ENTRY], {"gpu_data": [AMD_ENTRY]}], ids=["rocm6-list", "rocm7-gpu_data"]
)
def test_amd_smi_static_both_rocm_shapes(payload):
    facts = gf.gpu_facts(amd_static=json.dumps(payload), rocm_version="6.4.1-120\n")
    assert facts["vendor"] == "amd"
    assert facts["count"] == 1
    assert facts["model"] == "AMD Instinct MI300X"
    assert facts["arch"] == "cdna3"
    assert facts["gfx_target"] == "gfx942"
    assert facts["memory_mib"] == 196592
    assert facts["driver_version"] == "6.12.12"
    assert facts["rocm_version"] == "6.4.1"


def test_rocm_smi_json():
    text = json.dumps(
        {
            "card0": {
                "Card Series": "AMD Instinct MI355X",
                "GFX Version": "gfx950",
                "VRAM Total Memory (B)": str(294896 * 1048576),
            },
            "system": {"Driver version": "6.14.14"},
        }
    )
    facts = gf.gpu_facts(rocm_smi=text)
    assert (facts["count"], facts["arch"], facts["gfx_target"]) == (1, "cdna4", "gfx950")
    assert facts["memory_mib"] == 294896
    assert facts["driver_version"] == "6.14.14"


IBSTAT = """CA 'mlx5_0'
\tCA type: MT4129
\tNumber of ports: 1
\tFirmware version: 28.39.1002
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 400
\t\tLink layer: InfiniBand
CA 'mlx5_1'
\tCA type: MT4129
\tPort 1:
\t\tState: Down
\t\tPhysical state: Disabled
\t\tRate: 10
\t\tLink layer: Ethernet
"""


def test_ibstat_and_peermem():
    lsmod = "Module                  Size  Used by\nnvidia_peermem         16384  0\n"
    facts = gf.ib_facts(ibstat=IBSTAT, lsmod=lsmod)
    assert facts["count"] == 2
    assert facts["active"] == ["mlx5_0"]
    assert facts["all_active"] is False
    assert facts["link_layers"] == ["Ethernet", "InfiniBand"]
    assert facts["hcas"][0]["ports"][0]["rate_gbps"] == 400
    assert facts["peermem_loaded"] is True


def test_ibv_devinfo_without_devices():
    facts = gf.ib_facts(ibv_devinfo="No IB devices found\n", lsmod="")
    assert facts["present"] is False
    assert facts["peermem_loaded"] is False


def test_imex_status():
    text = """Nodes:
Node #0   - 10.0.0.1        - READY                - Version: 580.159.04
Node #1   - 10.0.0.2        - UNAVAILABLE

 Nodes From\\To  0   1
       0        C   N
       1        N   N

Domain State: DOWN
"""
    imex = gf.parse_imex_status(text)
    assert imex["domain_state"] == "DOWN"
    assert [n["state"] for n in imex["nodes"]] == ["READY", "UNAVAILABLE"]
    assert imex["nodes"][0]["version"] == "580.159.04"
    assert imex["connectivity"] == {0: ["C", "N"], 1: ["N", "N"]}
    assert imex["all_connected"] is False


def test_fabric_manager_version():
    assert gf.parse_fabricmanager_version("Fabric Manager version is : 580.159.04\n") == (
        "580.159.04"
    )
    assert gf.parse_fabricmanager_version("nv-fabricmanager: not found") is None


def test_nothing_installed_is_empty_not_an_error():
    facts = gf.gpu_facts()
    assert facts["present"] is False
    assert facts["count"] == 0
    assert facts["gpus"] == []


@pytest.mark.skipif(not (DEVICE / "nvidia-smi-q.xml").exists(), reason="no device capture")
def test_device_capture_from_the_real_h200():
    def read(name):
        return (DEVICE / name).read_text()

    facts = gf.gpu_facts(
        xml=read("nvidia-smi-q.xml"),
        query=read("query-gpu.csv"),
        topo=read("topo.txt"),
        nvlink=read("nvlink-s.txt"),
        proc_version=read("proc-driver-nvidia-version.txt"),
    )
    assert facts["count"] >= 1
    assert facts["arch"] == "hopper"
    assert facts["compute_capability"] == "9.0"
    assert facts["driver_version"] == facts["kernel_module"]["version"]
    assert facts["memory_mib"] > 140000
    recorded = json.loads(read("facts.json"))
    assert recorded["model"] == facts["model"]
    assert recorded["driver_version"] == facts["driver_version"]


@pytest.mark.skipif(
    shutil.which("ansible") is None and not (REPO / ".venv/bin/ansible").exists(),
    reason="ansible not installed",
)
def test_ansible_module_against_simulated_h200(tmp_path):
    """`ansible localhost -m gpu_facts` with the lab's nvidia-smi first on PATH, in check mode."""
    from gpufleet_lab import hwsim

    for path, (content, mode) in hwsim.render("h200x8", [], "lab1").items():
        dest = tmp_path / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(content)
        dest.chmod(mode)
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    dev = tmp_path / "dev"  # the simulator's device list, as names (mknod needs root)
    dev.mkdir()
    for line in (tmp_path / "etc/gpufleet-lab/devices").read_text().splitlines():
        if line.startswith("/dev/nvidia"):
            (dev / Path(line.split()[0]).name).touch()
    for tool in (
        "usr/bin/nvidia-smi",
        "usr/bin/nv-fabricmanager",
        "usr/bin/ibv_devinfo",
        "usr/local/sbin/lsmod",
    ):
        (bindir / Path(tool).name).symlink_to(tmp_path / tool)
    ansible = shutil.which("ansible") or str(REPO / ".venv/bin/ansible")
    env = dict(
        os.environ,
        PATH=f"{bindir}:{os.environ['PATH']}",
        GPUFLEET_LAB_ROOT=str(tmp_path),
        ANSIBLE_COLLECTIONS_PATH=str(REPO / "collections"),  # the checkout's gpufleet.fleet
        ANSIBLE_STDOUT_CALLBACK="json",
        ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
        ANSIBLE_LOCALHOST_WARNING="0",
    )
    proc = subprocess.run(
        [
            ansible,
            "localhost",
            "-c",
            "local",
            "-m",
            "gpufleet.fleet.gpu_facts",
            "--check",
            # the module runs on this test's interpreter: scripts/host-pythons runs this
            # file under every host Python 3.8 .. 3.13
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            "-a",
            f"proc_driver_version={tmp_path}/etc/gpufleet-lab/proc/driver/nvidia/version"
            f" dev_dir={dev} pci_devices_dir={tmp_path}/no-pci",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert result["changed"] is False
    gpu = result["ansible_facts"]["gpufleet_gpu"]
    ib = result["ansible_facts"]["gpufleet_ib"]
    assert (gpu["count"], gpu["model"], gpu["compute_capability"]) == (8, "NVIDIA H200", "9.0")
    assert gpu["kernel_module"]["version"] == "580.159.04"
    assert gpu["fabric_manager_version"] == "580.159.04"
    assert gpu["topology"]["gpu_link"] == "NV18"
    assert gpu["errors"] == []
    assert ib["active"] == [f"mlx5_{i}" for i in range(8)]
    # HGX H200 owns its four NVSwitches: the fabric manager runs here
    assert gpu["nvswitches"] == [str(dev / f"nvidia-nvswitch{i}") for i in range(4)]
    assert gpu["fabric_manager"] == "local"
    assert gpu["fabric_problem"] is None


# --------------------------------------------------------------------------- fabric manager:
# where the NVLink fabric is managed, from the GPUs' fabric state and the switches the host
# sees (a real 2x H200 virtual machine: fabric Completed/Success, no NVSwitch of its own).

H200X2 = REPO / "tests/fixtures/hardware/h200x2"


def h200x2_facts(nvswitches=(), state=None, status=None):
    xml = (H200X2 / "nvidia-smi-q.xml").read_text()
    if state:
        xml = xml.replace("<state>Completed</state>", f"<state>{state}</state>")
    if status:
        xml = xml.replace("<status>Success</status>", f"<status>{status}</status>")
    return gf.gpu_facts(
        xml=xml,
        topo=(H200X2 / "topo.txt").read_text(),
        nvlink=(H200X2 / "nvlink-s.txt").read_text(),
        nvswitches=list(nvswitches),
    )


def test_real_2x_h200_vm_fabric_is_managed_outside_it():
    facts = h200x2_facts()
    assert (facts["count"], facts["model"]) == (2, "NVIDIA H200")
    assert facts["driver_version"] == "580.159.04"
    assert facts["topology"]["gpu_link"] == "NV18"
    assert facts["nvlink"]["active_links_per_gpu"] == [18, 18]
    assert [g["bus_id"] for g in facts["gpus"]] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert facts["fabric"] == {
        "state": "Completed",
        "status": "Success",
        "clique_id": "0",
        "cluster_uuid": "00000000-0000-0000-0000-000000000000",
        "completed": True,
        "ok": True,
        "supported": True,
    }
    assert facts["nvswitches"] == []
    assert facts["fabric_manager"] == "external"
    assert facts["fabric_problem"] is None


def test_switches_the_host_owns_make_the_fabric_manager_local():
    facts = h200x2_facts(nvswitches=["/dev/nvidia-nvswitch0"], state="In Progress", status="N/A")
    assert facts["fabric_manager"] == "local"
    assert facts["fabric_problem"] is None  # the local fabric manager brings it up


@pytest.mark.parametrize(
    "state, status",
    [("In Progress", "N/A"), ("Not Started", "N/A"), ("Completed", "NV_ERR_NVLINK_BAD_STATE")],
)
def test_external_fabric_not_up_is_refused_with_its_state_and_the_fix(state, status):
    facts = h200x2_facts(state=state, status=status)
    assert facts["fabric_manager"] == "external"
    assert facts["fabric"]["ok"] is False
    problem = facts["fabric_problem"]
    assert f"Fabric State {state}, Status {status}" in problem
    assert "no /dev/nvidia-nvswitch*" in problem
    assert "Fix: the hypervisor's fabric manager" in problem


def test_no_switch_and_no_fabric_is_none_and_refused():
    facts = gf.gpu_facts(xml=(H200 / "nvidia-smi-q.xml").read_text(), nvswitches=[])
    assert facts["fabric_manager"] == "none"
    assert "Fabric State N/A" in facts["fabric_problem"]
    assert "Fix: use hosts whose GPUs share an NVSwitch fabric" in facts["fabric_problem"]


def test_not_decided_without_looking_for_switches():
    facts = h200x2_facts()
    undecided = gf.gpu_facts(xml=(H200X2 / "nvidia-smi-q.xml").read_text())
    assert facts["fabric_manager"] == "external"
    assert (undecided["nvswitches"], undecided["fabric_manager"]) == (None, None)
    assert undecided["fabric_problem"] is None


def test_find_nvswitches_device_nodes_and_pci_functions(tmp_path):
    dev, pci = tmp_path / "dev", tmp_path / "pci"
    names = ("nvidia0", "nvidiactl", "nvidia-nvswitchctl", "nvidia-nvswitch0", "nvidia-nvswitch1")
    for name in names:
        (dev / name).parent.mkdir(parents=True, exist_ok=True)
        (dev / name).touch()
    functions = {
        "0000:05:00.0": ("0x10de", "0x068000"),  # NVSwitch (bridge, other)
        "0000:18:00.0": ("0x10de", "0x030200"),  # H200 (3D controller)
        "0000:00:1f.0": ("0x8086", "0x068000"),  # someone else's bridge
    }
    for function, (vendor, klass) in functions.items():
        (pci / function).mkdir(parents=True)
        (pci / function / "vendor").write_text(vendor + "\n")
        (pci / function / "class").write_text(klass + "\n")
    assert gf.find_nvswitches(str(dev), str(pci)) == [
        str(dev / "nvidia-nvswitch0"),
        str(dev / "nvidia-nvswitch1"),
        "pci:0000:05:00.0",
    ]
    assert gf.find_nvswitches(str(tmp_path / "none"), str(tmp_path / "none")) == []


def test_preflight_refuses_an_external_fabric_that_is_not_up_before_any_change():
    from gpufleet.module_utils import preflight

    req = {"fabric_manager": True}
    assert preflight.check_host(req, h200x2_facts()) == []
    problems = preflight.check_host(req, h200x2_facts(state="In Progress", status="N/A"))
    assert len(problems) == 1 and "Fabric State In Progress" in problems[0]
    # a target without an NVSwitch fabric does not care
    assert preflight.check_host({}, h200x2_facts(state="In Progress", status="N/A")) == []


@pytest.mark.parametrize(
    "state, healthy",
    [("Completed", True), ("In Progress", False)],
)
def test_health_checker_checks_an_external_fabric_state(monkeypatch, state, healthy):
    from gpufleet.host import healthcheck

    xml = (
        (H200X2 / "nvidia-smi-q.xml")
        .read_text()
        .replace("<state>Completed</state>", f"<state>{state}</state>")
    )
    nvlink = (H200X2 / "nvlink-s.txt").read_text()
    outputs = {("-q", "-x"): xml, ("nvlink", "-s"): nvlink, ("nvlink", "-e"): ""}
    monkeypatch.setattr(healthcheck.shutil, "which", lambda tool: "/usr/bin/" + tool)
    monkeypatch.setattr(healthcheck, "run", lambda argv, timeout: (0, outputs[tuple(argv[1:])],
                                                                   ""))

    def fabric_result(gpu):
        cfg = healthcheck.validate({"gpu": gpu})["gpu"]
        results, data = healthcheck.check_nvidia(cfg, {})
        assert len(data["gpus"]) == 2
        return next(r for r in results if r["check"] == "gpu_fabric")

    result = fabric_result({"vendor": "nvidia", "count": 2, "fabric": True})
    if healthy:
        assert result["status"] == "ok", result
        assert "NVLink fabric Completed/Success" in result["detail"]
    else:
        assert result["status"] == "fail"
        assert "GPU 1 (GPU-fda287b8-4d96-ad0b-7f3d-0efabb9894f4, 00000000:00:07.0): fabric " \
               "In Progress/Success" in result["detail"]
        assert "Action: the fabric is managed outside this host: the hypervisor's fabric " \
               "manager" in result["detail"]
    # a host that runs its own fabric manager: the same state, its fix
    result = fabric_result({"vendor": "nvidia", "count": 2})
    assert result["status"] == ("ok" if healthy else "fail")
    if not healthy:
        assert "Action: check nvidia-fabricmanager" in result["detail"]

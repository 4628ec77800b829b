"""The health checker against the lab's simulated hardware, with the faults a running host
develops: the checker runs as installed (stdlib only), the simulated nvidia-smi, amd-smi and the
HCAs' sysfs files answer as a faulty host's would (lab/gpufleet_lab/hwsim_data/hwlab.py,
GPU_FAULTS). Each fault must fail exactly its check, naming the component and the action.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet_lab import hwsim

REPO = Path(__file__).resolve().parents[2]

# fault -> (what the simulator is told, the check that fails, what its detail says)
GPU_FAULTS = {
    "uncorrectable ECC": ({"xml": {"1": {"dram_uncorrectable": "3"}}}, "gpu_ecc",
                          r"GPU 1 \(GPU-[^)]+\): 3 uncorrected ECC errors since the "
                          r"driver loaded\. Action: drain the host and reset the GPU"),
    "remap pending": ({"xml": {"0": {"remapped_row_pending": "Yes"}}}, "gpu_remap",
                      r"GPU 0 \(GPU-[^)]+\): row remapping pending\. Action: drain"),
    "remap failed": ({"xml": {"0": {"remapped_row_failure": "Yes"}}}, "gpu_remap",
                     r"GPU 0 \(GPU-[^)]+\): row remapping failed\. Action: replace the GPU"),
    "NVLink down": ({"nvlink_inactive": {"1": [3, 4]}}, "gpu_nvlink",
                    r"GPU 1 \(GPU-[^)]+\): NVLink 3, 4 inactive \(16 of 18 active\)\. "
                    r"Action: reset"),
    "NVLink recovery": ({"nvlink_errors": {"0": {"Recovery Errors": 2}}}, "gpu_nvlink",
                        r"GPU 0 \(GPU-[^)]+\): NVLink recovery errors rose by 2 since the "
                        r"last run"),
    "PCIe at x8": ({"xml": {"1": {"current_link_width": "8x"}}}, "gpu_pcie",
                   r"GPU 1 \(GPU-[^)]+\): PCIe link x8 of x16\. Action: reseat"),
    "HW slowdown": ({"xml": {"0": {"clocks_event_reason_hw_slowdown": "Active"}}}, "gpu_clocks",
                    r"GPU 0 \(GPU-[^)]+\): hardware slowdown .*Action: check the GPU's cooling "
                    r"and the power supply"),
    "fabric Insufficient Resources": (
        {"xml": {"1": {"status": "Insufficient Resources"}}}, "gpu_fabric",
        r"GPU 1 \(GPU-[^)]+\): fabric Completed/Insufficient Resources\. Action: the fabric is "
        r"managed outside this host"),
}


# AMD (the lab's 8x MI355X, amd-smi 26.x): fault -> (faults file, check, detail)
AMD_FAULTS = {
    "AMD uncorrectable ECC": (
        {"amd_ecc_blocks": {"1": {"UMC": {"uncorrectable_count": 3}}}}, "gpu_ecc",
        r"GPU 1 \([0-9a-f-]+, 0000:15:00\.0\): 3 uncorrectable ECC errors in UMC since the "
        r"driver loaded\. Action: drain the host and reset the GPU \(amd-smi reset --gpureset "
        r"-g 1\); replace it"),
    "AMD RAS error": ({"amd_ras_state": {"0": {"GFX": "MULT_UC"}}}, "gpu_ecc",
                      r"GPU 0 \([0-9a-f-]+, 0000:05:00\.0\): RAS block GFX reports MULT_UC\. "
                      r"Action: drain the host and reset the GPU"),
    "AMD hotspot": ({"amd_temperature": {"2": {"hotspot": 107}}}, "gpu_thermal",
                    r"GPU 2 \([0-9a-f-]+, 0000:65:00\.0\): hotspot 107 C, above 100 C\. "
                    r"Action: check the GPU's cooling"),
    "AMD XGMI link down": ({"amd_xgmi_down": {"3": [5]}}, "gpu_xgmi",
                           r"GPU 3 \([0-9a-f-]+, 0000:75:00\.0\): XGMI link 5 down \(6 of 7 "
                           r"up\)\. Action: reset the GPU \(amd-smi reset --gpureset -g 3\)"),
    "AMD XGMI errors": ({"amd_ecc_blocks": {"4": {"XGMI_WAFL": {"uncorrectable_count": 1}}}},
                        "gpu_xgmi", r"GPU 4 \([0-9a-f-]+, 0000:85:00\.0\): 1 uncorrectable "
                        r"XGMI errors \(RAS block XGMI_WAFL\).*Action: drain the host"),
}


class LabHost:
    """A lab host's simulated hardware rendered under tmp (GPUFLEET_LAB_ROOT), with the
    checker installed as the health role installs it."""

    def __init__(self, root: Path, profile: str):
        self.root = root
        for path, (content, mode) in hwsim.render(profile, [], "lab1").items():
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(content)
            dest.chmod(mode)
        lib = root / "usr/local/lib/gpufleet"
        lib.mkdir(parents=True)
        shutil.copy(REPO / "gpufleet/host/healthcheck.py", lib)
        shutil.copy(REPO / "gpufleet/module_utils/gpu_facts.py", lib)
        self.checker = lib / "healthcheck.py"
        self.bin = root / "bin"
        self.bin.mkdir()
        for tool in ("nvidia-smi", "amd-smi"):  # the simulated tools first on PATH
            rendered = root / "usr/bin" / tool
            if rendered.exists():
                (self.bin / tool).write_text(f"#!/bin/sh\nexec {sys.executable} {rendered} "
                                             '"$@"\n')
                (self.bin / tool).chmod(0o755)
        self.env = {"PATH": f"{self.bin}:/usr/bin:/bin", "GPUFLEET_LAB_ROOT": str(root),
                    "LANG": "C.UTF-8"}
        self.config = root / "health.json"

    def configure(self, **top) -> None:
        cfg = {"version": 1, "host": "lab1", "units": [],
               "textfile": str(self.root / "gpufleet.prom"),
               "state_file": str(self.root / "state.json")}
        cfg.update(top)
        self.config.write_text(json.dumps(cfg))

    def inject(self, faults: dict) -> None:
        path = self.root / "var/lib/gpufleet-lab/gpu-faults.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(faults))

    def check(self) -> tuple[int, dict]:
        proc = subprocess.run([sys.executable, "-I", "-S", str(self.checker), "--config",
                               str(self.config), "--json"], env=self.env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode in (0, 1), proc.stdout + proc.stderr
        return proc.returncode, {c["check"]: c for c in json.loads(proc.stdout)["checks"]}


@pytest.fixture
def vm(tmp_path):
    """The lab's 2x H200 VM (NV18, fabric run by the hypervisor)."""
    host = LabHost(tmp_path, "h200x2")
    host.configure(gpu={"vendor": "nvidia", "count": 2, "fabric": True})
    return host


def test_the_healthy_simulated_host_passes_every_gpu_check(vm):
    code, checks = vm.check()
    gpu_checks = {c: checks[c]["status"] for c in checks if c.startswith("gpu")}
    assert code == 0 or gpu_checks["gpu_xid"] != "ok", checks
    assert {c: s for c, s in gpu_checks.items() if c != "gpu_xid"} == dict.fromkeys(
        ["gpu", "gpu_ecc", "gpu_remap", "gpu_pcie", "gpu_clocks", "gpu_fabric", "gpu_nvlink"],
        "ok"), checks
    assert "36 NVLink links active on 2 GPUs" in checks["gpu_nvlink"]["detail"]


def fails_only_its_check(host, faults, check, detail):
    """The fault injected: exactly its check fails, with its detail; repaired, green again
    (NVIDIA: a counter that rose once stays where it is; AMD's counts are since the driver
    loaded, a reset clears them)."""
    host.inject(faults)
    code, checks = host.check()
    assert code == 1
    failed = sorted(c for c, r in checks.items() if r["status"] == "fail" and c != "gpu_xid")
    assert failed == [check], checks
    assert re.search(detail, checks[check]["detail"]), checks[check]["detail"]
    host.inject({})
    assert host.check()[1][check]["status"] == "ok"


@pytest.mark.parametrize("fault", sorted(GPU_FAULTS))
def test_each_gpu_fault_fails_its_check_naming_gpu_and_action(vm, fault):
    assert vm.check()[0] in (0, 1)  # a baseline run: the counters' last values
    fails_only_its_check(vm, *GPU_FAULTS[fault])


def test_the_simulated_gpus_and_the_real_capture_say_the_same(vm):
    """The simulator's XML is the real capture's layout: the fields the checks read exist."""
    out = subprocess.run([str(vm.bin / "nvidia-smi"), "-q", "-x"], env=vm.env,
                         capture_output=True, text=True, check=True).stdout
    for tag in ("current_link_width", "max_link_gen", "clocks_event_reason_hw_slowdown",
                "remapped_row_pending", "dram_uncorrectable", "<fabric>"):
        assert tag in out


@pytest.fixture
def hgx(tmp_path):
    """The lab's 8x H200 with eight HCAs; only the ib check (GPUs are the tests above)."""
    host = LabHost(tmp_path, "h200x8")
    host.configure(gpu={"vendor": None},
                   ib={"sysfs": str(tmp_path / "etc/gpufleet-lab/sys/class/infiniband")})
    return host


def test_hca_ports_down_slow_or_flapping(hgx):
    code, checks = hgx.check()
    assert checks["ib"]["status"] == "ok", checks["ib"]
    assert "8 ports ACTIVE/LinkUp at 400 Gb/s" in checks["ib"]["detail"]
    port = hgx.root / "etc/gpufleet-lab/sys/class/infiniband"
    (port / "mlx5_3/ports/1/state").write_text("1: DOWN\n")
    (port / "mlx5_3/ports/1/phys_state").write_text("3: Disabled\n")
    (port / "mlx5_5/ports/1/rate").write_text("100 Gb/sec (4X EDR)\n")
    (port / "mlx5_6/ports/1/counters/link_error_recovery").write_text("1\n")
    code, checks = hgx.check()
    assert code == 1
    detail = checks["ib"]["detail"]
    assert "HCA mlx5_3 port 1: DOWN (physical Disabled). Action: check the cable" in detail
    assert "HCA mlx5_5 port 1: 100 Gb/s, expected 400" in detail
    assert "HCA mlx5_6 port 1: link_error_recovery rose by 1" in detail


@pytest.fixture
def mi355(tmp_path):
    """The lab's 8x MI355X (XGMI between all eight)."""
    host = LabHost(tmp_path, "mi355x8")
    host.configure(gpu={"vendor": "amd", "count": 8})
    return host


def test_the_healthy_simulated_amd_host_passes_every_gpu_check(mi355):
    code, checks = mi355.check()
    gpu_checks = {c: checks[c]["status"] for c in checks if c.startswith("gpu") and c != "gpu_xid"}
    assert gpu_checks == dict.fromkeys(["gpu", "gpu_ecc", "gpu_thermal", "gpu_xgmi"], "ok"), checks
    assert "56 XGMI links up on 8 GPUs" in checks["gpu_xgmi"]["detail"]
    assert re.match(r"8 GPUs: 0 [0-9a-f-]+ 0000:05:00\.0, 1 ", checks["gpu"]["detail"])
    prom = (mi355.root / "gpufleet.prom").read_text()
    assert 'gpufleet_gpu_xgmi_links{gpu="0",state="up",uuid="' in prom
    assert re.search(r'gpufleet_gpu_temperature_celsius\{gpu="2",uuid="[^"]+"\} 43', prom)


@pytest.mark.parametrize("fault", sorted(AMD_FAULTS))
def test_each_amd_fault_fails_its_check_naming_gpu_and_action(mi355, fault):
    fails_only_its_check(mi355, *AMD_FAULTS[fault])


def test_a_dead_amdgpu_driver_fails_the_gpu_check(mi355):
    (mi355.root / "etc/gpufleet-lab/modules").write_text("")  # amdgpu unloaded
    code, checks = mi355.check()
    assert code == 1 and checks["gpu"]["status"] == "fail", checks["gpu"]
    assert "amd-smi list: AMDSMI_STATUS_DRIVER_NOT_LOADED" in checks["gpu"]["detail"]
    assert "Action: check the amdgpu driver" in checks["gpu"]["detail"]
    assert {checks[c]["status"] for c in ("gpu_ecc", "gpu_thermal", "gpu_xgmi")} == {"na"}

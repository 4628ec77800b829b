"""gpufleet/host/acceptance.py against a lab host's simulated hardware: the lab's torch
stand-in (lab/standins/shims/torch) answers from the rendered profile and the faults
injected into it, nvidia-smi is the lab's, so the verdicts and the evidence they name
come from the same files the lab hosts read."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet import catalog
from gpufleet.acceptance import SIZES_MIB
from gpufleet_lab import hwsim

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "gpufleet/host/acceptance.py"
TORCH = REPO / "lab/standins/shims/torch"
PYENV = os.environ.get("HOST_PYTHONS_DIR", "/root/.pyenv/versions")

pytestmark = pytest.mark.timeout(120)


def host_python(version: str) -> str:
    found = sorted(glob.glob(f"{PYENV}/{version}.*/bin/python")) or [shutil.which(
        f"python{version}") or ""]
    assert found[-1], f"no Python {version} (HOST_PYTHONS_DIR or python{version} on PATH)"
    return found[-1]


class Host:
    """A 2x H200 lab host (profile h200x2: NV18, the fabric up) rendered under tmp, with
    an engine environment whose Python imports the torch stand-in."""

    def __init__(self, root: Path, profile: str = "h200x2", name: str = "lab1"):
        self.root = root
        for path, (content, mode) in hwsim.render(profile, [], name).items():
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(content)
            dest.chmod(mode)
        # the device nodes, as names (mknod needs root): the GPUs PyTorch finds
        for line in (root / "etc/gpufleet-lab/devices").read_text().splitlines():
            if line.startswith("/dev/"):
                node = root / line.split()[0].lstrip("/")
                node.parent.mkdir(parents=True, exist_ok=True)
                node.touch()
        self.bin = root / "bin"
        self.bin.mkdir()
        (self.bin / "nvidia-smi").write_text(
            f"#!/bin/sh\nexec {sys.executable} {root}/usr/bin/nvidia-smi \"$@\"\n")
        self.python = root / "venv/bin/python"  # the engine venv: PyTorch importable
        self.python.parent.mkdir(parents=True)
        self.python.write_text(f"#!/bin/sh\nPYTHONPATH={TORCH} exec {sys.executable} \"$@\"\n")
        for tool in (self.bin / "nvidia-smi", self.python):
            tool.chmod(0o755)
        self.env = {"PATH": f"{self.bin}:/usr/bin:/bin", "GPUFLEET_LAB_ROOT": str(root),
                    "LANG": "C.UTF-8"}
        expect = catalog.load().hardware["h200"].acceptance
        self.spec = {"host": name, "python": str(self.python),
                     "groups": [{"name": "worker", "gpus": [0, 1]}], "gpus": [0, 1],
                     "sizes_mib": SIZES_MIB, "threshold": 0.8, "timeout_s": 30,
                     "expect": expect.model_dump(exclude={"source"}),
                     "env": {"NCCL_NVLS_ENABLE": "0"}}

    def inject(self, faults: dict):
        path = self.root / "var/lib/gpufleet-lab/gpu-faults.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(faults))

    def start(self, interpreter: str = sys.executable, **spec) -> subprocess.Popen:
        proc = subprocess.Popen([interpreter, "-I", "-B", str(PROGRAM), "run", "--spec", "-",
                                 "--json"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self.env, text=True)
        proc.stdin.write(json.dumps({**self.spec, **spec}))
        proc.stdin.close()
        return proc

    @staticmethod
    def result(proc: subprocess.Popen) -> tuple[int, dict, str]:
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.wait(timeout=100)
        return proc.returncode, json.loads(out) if out.strip() else {}, err

    def run(self, interpreter: str = sys.executable, **spec) -> tuple[int, dict, str]:
        return self.result(self.start(interpreter, **spec))

    def failed(self, report: dict) -> list[dict]:
        return [c for c in report["checks"] if c["verdict"] == "FAIL"]


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


@pytest.mark.parametrize("version", ["3.8", "3.13"])
def test_a_healthy_pair_passes_with_every_figure_against_the_profile(host, version):
    code, report, err = host.run(host_python(version))
    assert code == 0, err
    assert report["passed"] is True and report["host"] == "lab1"
    nccl = [c for c in report["checks"] if c["kind"] == "nccl"]
    assert [c["size_mib"] for c in nccl] == SIZES_MIB
    assert all(c["gpus"] == [0, 1] and c["unit"] == "GB/s" for c in nccl)
    gpu = [c for c in report["checks"] if c["kind"] == "gpu"]
    assert sorted((c["name"], c["metric"]) for c in gpu) == [
        (f"GPU {g}", m) for g in (0, 1) for m in ("mem_write_gbs", "tflops_bf16")]
    for c in nccl + gpu:
        assert c["verdict"] == "pass" and c["ratio"] >= 0.8, c
        assert c["expected"] > 0 and c["measured"] == pytest.approx(c["ratio"] * c["expected"],
                                                                    rel=0.01)
    assert "dcgm" not in {c["kind"] for c in report["checks"]}  # DCGM not installed


def test_nvlink_links_down_lower_the_bus_bandwidth_and_are_named(host):
    host.inject({"nvlink_inactive": {"1": list(range(10))}})
    code, report, _ = host.run()
    assert code == 1 and report["passed"] is False
    failed = host.failed(report)
    assert {c["kind"] for c in failed} == {"nccl"}  # each GPU alone is fine
    assert len(failed) == len(SIZES_MIB)
    for c in failed:
        assert c["ratio"] == pytest.approx(8 / 18, abs=0.08)
        assert "GPU 1: NVLink links 0,1,2,3,4,5,6,7,8,9 inactive" in c["detail"]


def test_a_hung_collective_is_stopped_at_the_timeout_and_named(host):
    host.inject({"nccl_hang": True})
    code, report, _ = host.run(timeout_s=3)
    assert code == 1
    (hung,) = [c for c in report["checks"] if c["kind"] == "nccl"]
    assert hung["verdict"] == "FAIL"
    assert "hung collective: the all_reduce worker across GPUs 0,1 did not finish in 3 s" in hung[
        "detail"]
    assert "fabric manager" in hung["detail"]  # no link down: where to look next
    left = subprocess.run(["pgrep", "-f", f"{PROGRAM} nccl-rank"], capture_output=True)
    assert left.returncode == 1, left.stdout  # every rank was killed


def test_memory_words_read_back_wrong_and_a_wrong_matmul_name_the_gpu_and_the_action(host):
    host.inject({"memory_errors": {"0": 3}, "matmul_error": {"1": 0.5}})
    code, report, _ = host.run()
    assert code == 1
    failed = {(c["name"], c.get("metric")): c["detail"] for c in host.failed(report)}
    assert set(failed) == {("GPU 0", "mem_write_gbs"), ("GPU 1", "tflops_bf16")}
    assert failed["GPU 0", "mem_write_gbs"].startswith("12 words read back wrong")  # 4 patterns
    assert "reset the GPU" in failed["GPU 0", "mem_write_gbs"]
    assert "relative error 0.5" in failed["GPU 1", "tflops_bf16"]


def test_without_expectations_the_figures_are_reported_without_a_verdict(host):
    code, report, _ = host.run(expect={})
    assert code == 0
    assert {c["verdict"] for c in report["checks"]} == {"measured"}
    assert all(c["measured"] > 0 and c["ratio"] is None for c in report["checks"])


def test_dcgm_diag_runs_where_installed_and_its_failure_fails_the_host(host):
    dcgmi = host.bin / "dcgmi"
    dcgmi.write_text("#!/bin/sh\necho \"$@\" > \"$0.args\"\n"
                     "echo '| Memory  | Fail - GPU 1: double-bit ECC |'\nexit 226\n")
    dcgmi.chmod(0o755)
    code, report, _ = host.run()
    assert code == 1
    (dcgm,) = host.failed(report)
    assert dcgm["kind"] == "dcgm" and "GPU 1: double-bit ECC" in dcgm["detail"]
    assert (host.bin / "dcgmi.args").read_text().split() == ["diag", "-r", "1"]


@pytest.mark.parametrize("change, words", [
    ({"python": "/nonexistent/bin/python"}, "is not an executable: the engine environment"),
    ({"groups": [{"name": "worker", "gpus": [0, 5]}]}, "group worker: GPUs [5] are not in"),
    ({"gpus": [0, 1, 2]}, "sees 2 GPUs; the plan uses GPU 2"),
    ({"python": sys.executable}, "PyTorch does not load in the engine environment"),
])
def test_an_unusable_spec_or_environment_exits_2_before_measuring(host, change, words):
    code, report, err = host.run(**change)
    assert code == 2 and report == {}
    assert words in err


def test_pytorch_finds_only_the_gpus_whose_device_node_it_sees(host):
    (host.root / "dev/nvidia1").unlink()  # a container given GPU 0 alone by CDI
    code, _, err = host.run()
    assert code == 2 and "sees 1 GPUs; the plan uses GPU 1" in err


def test_the_all_reduce_across_two_hosts_runs_at_the_hcas_rate_and_a_slow_port_is_named(
        tmp_path):
    hosts = [Host(tmp_path / name, "h200x8", name) for name in ("lab1", "lab2")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def both():
        procs = [h.start(gpus=[0, 1], groups=[], ib_sysfs=str(
            h.root / "etc/gpufleet-lab/sys/class/infiniband"), fabric={
            "over": "ib", "hosts": ["lab1", "lab2"], "gpus_per_host": [2, 2], "node_rank": i,
            "master": "127.0.0.1", "port": port}) for i, h in enumerate(hosts)]
        return [Host.result(p) for p in procs]

    for code, report, err in both():
        assert code == 0, err
        fabric = [c for c in report["checks"] if c["kind"] == "fabric"]
        assert [c["size_mib"] for c in fabric] == SIZES_MIB
        assert all(c["verdict"] == "pass" and c["name"] == "over IB (lab1, lab2)" for c in fabric)
        # 8 HCAs x 400 Gb/s, as much as NVLink inside the host lets through
        assert fabric[-1]["expected"] == pytest.approx(min(400 * 0.92, 329))
        hca = [c for c in report["checks"] if c["kind"] == "hca"]
        assert len(hca) == 8 and all(c["verdict"] == "pass" for c in hca)

    rate = hosts[1].root / "etc/gpufleet-lab/sys/class/infiniband/mlx5_3/ports/1/rate"
    rate.write_text("100 Gb/sec (4X HDR)\n")  # one port of lab2 trained down
    (one, two) = both()
    assert one[0] == two[0] == 1
    for _code, report, _err in (one, two):
        slow = [c for c in report["checks"] if c["kind"] == "fabric" and c["size_mib"] == 1024]
        assert slow[0]["verdict"] == "FAIL" and slow[0]["ratio"] < 0.5
    (named,) = [c for c in two[1]["checks"] if c["verdict"] == "FAIL" and c["kind"] == "hca"]
    assert named["detail"].startswith("mlx5_3 port 1 at 100 Gb/s, the others at 400")
    lab1_fabric = next(c for c in one[1]["checks"] if c["kind"] == "fabric")
    assert "see the other hosts' hca checks" in lab1_fabric["detail"]


@pytest.mark.parametrize("profile, hardware", [("b300x8", "b300"), ("gb300x4", "gb300")])
def test_a_blackwell_ultra_node_meets_its_catalog_figures(tmp_path, profile, hardware):
    """The catalog's acceptance figures for B300 / GB300 against the lab profile of that
    hardware: every GPU of the node in one all_reduce, each GPU's matmul and memory writes."""
    h = Host(tmp_path, profile)
    gpus = list(range(len(hwsim.PROFILES[profile]["bus_ids"])))
    expect = catalog.load().hardware[hardware].acceptance.model_dump(exclude={"source"})
    code, report, err = h.run(groups=[{"name": "worker", "gpus": gpus}], gpus=gpus,
                              expect=expect)
    assert code == 0, err
    assert report["passed"] is True
    checks = report["checks"]
    assert len(checks) == len(SIZES_MIB) + 2 * len(gpus)
    for c in checks:
        assert c["verdict"] == "pass" and c["ratio"] >= 0.8, c

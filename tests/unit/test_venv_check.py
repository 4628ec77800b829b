"""gpufleet/host/venv_check.py: an engine venv against its lock, and a host's Python.

The program runs as a subprocess of this Python (scripts/host-pythons runs this file under
every host Python, 3.8 to 3.13), as the role runs it (``python -I -B -c SOURCE ARGS``),
against locks in the format of gpufleet/catalog/locks/ naming what this interpreter has
installed (pytest itself) and what it has not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "gpufleet" / "host" / "venv_check.py"
HASH = "    --hash=sha256:" + "0" * 64


def run(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-I", "-B", "-c", PROGRAM.read_text(), *args],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def lock(tmp_path: Path, pins: list) -> Path:
    """A lock as scripts/lock writes it: header comments, ``NAME==VERSION \\``, its hashes,
    a ``# via`` line."""
    lines = ["# Engine environment lock, made by scripts/lock: do not edit.", "# python: 3.11"]
    for pin in pins:
        lines += [pin + " \\", HASH + " \\", HASH, "    # via engines.vllm.requirements"]
    path = tmp_path / "requirements.lock"
    path.write_text("\n".join(lines) + "\n")
    return path


def check(path: Path) -> dict:
    rc, out, err = run("--lock", str(path))
    assert rc == 0, err
    return json.loads(out)


def test_lock_all_installed(tmp_path):
    found = check(lock(tmp_path, ["pytest==" + pytest.__version__]))
    assert found["locked"] == 1
    assert found["wrong"] == []


def test_lock_names_compare_normalized(tmp_path):
    # PyPI's Pytest, pytest, PYTEST are one distribution
    found = check(lock(tmp_path, ["PyTest==" + pytest.__version__]))
    assert found == {"locked": 1, "wrong": [], "flashinfer": {
        "flashinfer-python": None, "flashinfer-cubin": None, "flashinfer-jit-cache": None}}


def test_lock_wrong_version_and_missing(tmp_path):
    found = check(lock(tmp_path, ["pytest==0.0.1", "gpufleet-not-installed==1.2.3",
                                  "flashinfer_python==0.6.18"]))
    assert found["locked"] == 3
    assert found["wrong"] == [
        "flashinfer-python==0.6.18 (the venv has nothing)",
        "gpufleet-not-installed==1.2.3 (the venv has nothing)",
        f"pytest==0.0.1 (the venv has {pytest.__version__})",
    ]
    assert found["flashinfer"]["flashinfer-python"] is None


def test_repository_lock_reads_every_pin(tmp_path):
    # a real lock: every NAME== line counted, none of its hash or comment lines
    real = sorted((REPO / "gpufleet" / "catalog" / "locks").glob("vllm-x86_64-py*.txt"))[0]
    text = real.read_text()
    pins = [line for line in text.splitlines() if line[:1].isalnum() and "==" in line]
    found = check(real)
    assert found["locked"] == len(pins) > 10


def test_lock_unreadable(tmp_path):
    rc, out, err = run("--lock", str(tmp_path / "missing.lock"))
    assert rc == 2
    assert out == ""
    assert "cannot read the lock" in err


def test_host():
    rc, out, err = run("--host")
    assert rc == 0, err
    found = json.loads(out)
    assert set(found) == {"glibc", "venv", "ensurepip"}
    assert isinstance(found["glibc"], str)
    if sys.platform.startswith("linux"):
        # glibc everywhere gpufleet runs: "2.36"
        assert found["glibc"].split(".")[0].isdigit(), found
    assert found["venv"] is True
    assert isinstance(found["ensurepip"], bool)


def test_one_mode_required():
    rc, _, err = run()
    assert rc == 2
    assert "--lock" in err


def test_image_mode_reports_flashinfer_and_what_this_process_sees_of_rdma():
    rc, out, err = run("--image")
    assert rc == 0, err
    answer = json.loads(out)
    assert set(answer["flashinfer"]) == {"flashinfer-python", "flashinfer-cubin",
                                         "flashinfer-jit-cache"}
    assert isinstance(answer["uverbs"], list)
    # the capability as the kernel reports it for this very process
    cap_eff = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                       if line.startswith("CapEff:")).split()[1], 16)
    assert answer["ipc_lock"] == bool(cap_eff >> 14 & 1)


def test_image_mode_reads_devices_and_capabilities_it_is_given(tmp_path):
    sys.path.insert(0, str(PROGRAM.parent))
    try:
        import venv_check
    finally:
        sys.path.pop(0)
    dev = tmp_path / "infiniband"
    dev.mkdir()
    for name in ("uverbs1", "uverbs0", "rdma_cm"):
        (dev / name).touch()
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000004000\n")
    got = venv_check.image(str(dev), str(status))
    assert (got["uverbs"], got["ipc_lock"]) == (["uverbs0", "uverbs1"], True)
    status.write_text("Name:\tx\nCapEff:\t000001ffffffbfff\n")  # everything but IPC_LOCK
    got = venv_check.image(str(tmp_path / "none"), str(status))
    assert (got["uverbs"], got["ipc_lock"]) == ([], False)

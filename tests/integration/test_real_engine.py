"""One real install: the repository's vLLM lock for x86_64 / Python 3.11, with the real
wheels from pypi.org, through the engine_runtime role into lab1, then real vLLM's own
parser on the plan's command lines (the dry parse). Every other lab test installs the
lab's stand-in wheels; this one proves the lock installs as locked and that the vLLM it
pins takes the exact argv gpufleet renders.

- The controller (Debian 12, CPython 3.11, x86_64: the lab hosts' platform) downloads the
  lock's files once into REAL_WHEELS (about 4.4 GB; a later run finds them there and only
  reads the index); lab hosts reach nothing but the controller, so the test serves that
  folder on the controller's lab address as a PEP 503 index (the lab wheel source's handler
  on another directory) and points the role's index at it: no other index is asked.
- preflight + prepare of h200-pd-1node with the repository's locks (not the lab's).
- Asserted: the role installed; the venv holds vllm and torch at the locked versions with
  the real files (the largest file of each wheel on the host has the sha256 its wheel's
  RECORD gives); the role's dry parse ran on lab1; prefill's and decode's argv parse with
  real vLLM (run directly too, for the per-process answer); a misspelt flag is refused by
  real vLLM in its own words through the preflight role's dry parse.
- The venv (about 10.5 GB) and pip's cache on lab1 are removed at the end.

Slow (several minutes, network, disk): ``./scripts/test --slow`` or
``flock /tmp/gpufleet-lab.lock .venv/bin/pytest -s tests/integration/test_real_engine.py``.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from labutil import BIN, ENV, ROOT, recap
from labutil import ssh as lab_ssh

from gpufleet.model import host_slices
from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import services

pytestmark = [pytest.mark.lab, pytest.mark.slow]

TARGET = "h200-pd-1node"
HOST = "lab1"
VENV = "/opt/gpufleet/engines/vllm-0.33.0"
LOCK = ROOT / "gpufleet/catalog/locks/vllm-x86_64-py311.txt"
REAL_WHEELS = Path(os.environ.get("GPUFLEET_REAL_WHEELS", "/var/cache/gpufleet-lab/real-wheels"))
WHEELS = REAL_WHEELS / LOCK.stem
MIN_FREE_GB = 20
TIMEOUT = 2400


def _locked() -> dict[str, str]:
    """normalized name -> version, from the lock."""
    out = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def _free_gb(path: Path) -> float:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free / 1e9


def _du_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


class _RealWheels(services.WheelHandler):
    """The lab wheel source's handler (/simple/ and /wheels/) on WHEELS."""

    def __init__(self, *args, **kwargs):
        SimpleHTTPRequestHandler.__init__(self, *args, directory=str(WHEELS), **kwargs)

    def _files(self) -> list[Path]:
        return sorted(p for p in WHEELS.iterdir() if p.is_file() and services.project_of(p.name))


@pytest.fixture(scope="module")
def stats() -> dict:
    """Figures the tests fill in; printed at the end (pytest -s)."""
    out: dict = {"t0": time.monotonic()}
    yield out
    out["total_s"] = round(time.monotonic() - out.pop("t0"))
    print(f"\nreal engine install: {json.dumps(out, indent=1)}")


@pytest.fixture(scope="module")
def real_wheels(stats) -> Path:
    """The lock's files from pypi.org in WHEELS (pip reuses those already there)."""
    for path in (REAL_WHEELS, lab_hosts.STATE_DIR):
        free = _free_gb(path)
        if free < MIN_FREE_GB:
            pytest.fail(f"{path}: {free:.1f} GB free; the real vLLM install needs "
                        f"{MIN_FREE_GB} GB (about 4.4 GB of wheels, a 10.5 GB venv on {HOST}). "
                        "Fix: free space there, or set GPUFLEET_REAL_WHEELS to a folder on a "
                        "larger disk", pytrace=False)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--isolated", "--no-cache-dir",
         "--disable-pip-version-check", "--progress-bar", "off",
         "--index-url", "https://pypi.org/simple", "--no-deps", "--only-binary", ":all:",
         "--require-hashes", "-r", str(LOCK), "-d", str(WHEELS)],
        capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, (
        f"pip download of {LOCK.name} from pypi.org into {WHEELS} failed (the controller "
        f"needs pypi.org):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    files = [p for p in WHEELS.iterdir() if p.suffix == ".whl"]
    assert len(files) == len(_locked()), f"{len(files)} wheels in {WHEELS}, {len(_locked())} locked"
    stats.update(download_s=round(time.monotonic() - t0), wheels=len(files),
                 wheels_gb=round(_du_bytes(WHEELS) / 1e9, 2))
    return WHEELS


@pytest.fixture(scope="module")
def index_url(lab, real_wheels):
    """WHEELS as a PEP 503 index on the controller's lab address, on a free port."""
    server = ThreadingHTTPServer((services.controller_address(), 0), _RealWheels)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{services.controller_address()}:{server.server_address[1]}/simple"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def installed(index_url, stats, tmp_path_factory):
    """preflight + prepare of TARGET on the lab with the repository's locks and the real
    wheels; the venv and pip's cache on HOST are removed afterwards."""
    extra = tmp_path_factory.mktemp("real") / "vars.json"
    extra.write_text(json.dumps({
        "gpufleet_target": TARGET,
        "engine_runtime_lock_dir": str(ROOT / "gpufleet/catalog/locks"),
        "engine_runtime_index_url": index_url,
        "engine_runtime_trusted_host": services.controller_address(),
        # not the lab's gpufleet_pip_find_links: its stand-ins carry the real names
        "engine_runtime_find_links": "",
    }))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", "inventories/lab", "playbooks/preflight.yml",
             "playbooks/prepare.yml", "-e", f"@{extra}"],
            cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=TIMEOUT, check=False)
        stats["prepare_s"] = round(time.monotonic() - t0)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        stats["venv_gb"] = round(int(ssh(f"du -sb {VENV}").split()[0]) / 1e9, 2)
        yield proc
    finally:
        lab_ssh(HOST, f"rm -rf {VENV} /root/.cache/pip")
        assert lab_ssh(HOST, f"ls -d {VENV} /root/.cache/pip 2>/dev/null").strip() == ""


def ssh(command: str) -> str:
    return lab_ssh(HOST, command, check=True)


def _block(output: str, task: str, after: str = "") -> str:
    """The output of the first task named `task` after the text `after`."""
    rest = output.split(after, 1)[1] if after else output
    assert f"{task}] *" in rest, f"no task {task!r} in the output:\n{output[-4000:]}"
    return rest.split(f"{task}] *", 1)[1].split("TASK [", 1)[0]


def _plan() -> dict:
    proc = subprocess.run([str(BIN / "fab"), "plan", "--target", TARGET, "-i", "inventories/lab",
                           "--format", "json"], cwd=ROOT, capture_output=True, text=True, env=ENV,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _engine_processes(plan: dict) -> list[dict]:
    return [p for p in plan["processes"] if p["name"] in ("prefill", "decode")]


def _record_largest(prefix: str) -> tuple[str, str, int]:
    """(path, sha256 hex, size) of the largest file in the cached wheel named prefix*."""
    wheel = next(WHEELS.glob(f"{prefix}*.whl"))
    with zipfile.ZipFile(wheel) as whl:
        record = next(n for n in whl.namelist() if n.endswith(".dist-info/RECORD"))
        rows = [r for r in csv.reader(io.StringIO(whl.read(record).decode()))
                if len(r) == 3 and r[2]]
    path, digest, size = max(rows, key=lambda r: int(r[2]))
    b64 = digest.split("=", 1)[1]
    raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
    return path, raw.hex(), int(size)


def test_the_role_installs_the_real_lock(installed, stats):
    out = installed.stdout
    assert recap(out)[HOST]["failed"] == 0
    pip_block = _block(out, "Engine runtime | Install | pip install exactly the lock "
                            "(hashes checked, wheels only)")
    assert f"changed: [{HOST}]" in pip_block, pip_block

    listed = {re.sub(r"[-_.]+", "-", d["name"]).lower(): d["version"] for d in json.loads(
        ssh(f"{VENV}/bin/python -m pip list --format json --disable-pip-version-check"))}
    locked = _locked()
    assert listed["vllm"] == locked["vllm"] == "0.33.0"
    assert listed["torch"] == locked["torch"]
    assert {n: listed.get(n) for n in locked} == locked

    site = ssh(f"{VENV}/bin/python -c "
               "'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'").strip()
    for prefix in (f"torch-{locked['torch']}-", f"vllm-{locked['vllm']}-"):
        path, sha, size = _record_largest(prefix)
        got = ssh(f"stat -c %s {site}/{path} && sha256sum {site}/{path}").split()
        assert [int(got[0]), got[1]] == [size, sha], f"{site}/{path} on {HOST}: {got}"
        stats.setdefault("checked_files", []).append(f"{path} ({size / 1e6:.0f} MB)")
    assert stats["venv_gb"] > 5, f"{VENV} holds {stats['venv_gb']} GB: not the real wheels"


def _host_dry_parse(processes: list[dict]) -> tuple[int, dict, str]:
    """gpufleet/host/dry_parse.py with HOST's venv Python, as the role runs it."""
    program = (ROOT / "gpufleet/host/dry_parse.py").read_text()
    subprocess.run(lab_hosts.ssh_cmd(HOST, "cat > /tmp/gpufleet-dry-parse.py"), input=program,
                   text=True, check=True, capture_output=True, timeout=60)
    proc = subprocess.run(
        lab_hosts.ssh_cmd(HOST, f"{VENV}/bin/python -I -B /tmp/gpufleet-dry-parse.py"),
        input=json.dumps(processes), text=True, capture_output=True, timeout=600, check=False)
    assert proc.stdout.strip(), proc.stderr[-4000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_the_roles_dry_parse_ran_with_real_vllm(installed, stats):
    out = installed.stdout
    after_install = "Engine runtime | Install | pip install exactly the lock"
    block = _block(out, "Common | Dry parse | Each engine command line through the "
                        "installed engine's parser", after_install)
    assert f"ok: [{HOST}]" in block, block

    # the same program on the plan's exact argv, for each process's answer
    processes = [{k: p[k] for k in ("name", "argv", "env")} for p in _engine_processes(_plan())]
    assert [p["name"] for p in processes] == ["prefill", "decode"]
    t0 = time.monotonic()
    rc, answer, err = _host_dry_parse(processes)
    stats["dry_parse_s"] = round(time.monotonic() - t0, 1)
    stats["dry_parse"] = answer
    assert rc == 0 and answer["ok"], f"{answer}\n{err[-4000:]}"
    assert [(r["name"], r["engine"], r["version"], r["error"]) for r in answer["results"]] == [
        ("prefill", "vllm", "0.33.0", None), ("decode", "vllm", "0.33.0", None)]


def test_real_vllm_refuses_a_wrong_flag_in_its_own_words(installed, tmp_path, stats):
    plan = _plan()
    decode = next(p for p in _engine_processes(plan) if p["name"] == "decode")
    bad = {**decode, "argv": decode["argv"] + ["--max-num-sequences", "8"]}
    (tmp_path / "vars.json").write_text(json.dumps(
        {"gpufleet_host": host_slices(plan)[HOST], "common_dry_parse_processes": [bad],
         "common_dry_parse_report": False}))
    (tmp_path / "dry_parse.yml").write_text(
        f"- hosts: {HOST}\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role:\n        name: gpufleet.fleet.common\n"
        "        tasks_from: dry_parse\n")
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "inventories/lab", str(tmp_path / "dry_parse.yml"),
         "-e", f"@{tmp_path / 'vars.json'}"], cwd=ROOT, capture_output=True, text=True,
        env=ENV, timeout=600, check=False)
    said = " ".join(proc.stdout.split())
    assert proc.returncode != 0, said[-3000:]
    assert (f"process decode: vllm 0.33.0 in {VENV} refuses its command line: vllm serve: "
            "error: unrecognized arguments: --max-num-sequences 8. Fix:") in said, said[-3000:]
    stats["wrong_flag"] = re.search(r"refuses its command line: (.*?)\. Fix", said).group(1)

    # argparse takes an unambiguous prefix of a flag: real vLLM 0.33.0 reads --max-num-seq
    # as --max-num-seqs (its parser keeps allow_abbrev); an ambiguous one is refused
    rc, answer, err = _host_dry_parse([
        {**bad, "name": "prefix", "argv": decode["argv"] + ["--max-num-seq", "8"]},
        {**bad, "name": "ambiguous", "argv": decode["argv"] + ["--max-num", "8"]}])
    prefix, ambiguous = answer["results"]
    assert prefix["ok"] and prefix["error"] is None, f"{answer}\n{err[-3000:]}"
    assert not ambiguous["ok"]
    assert ambiguous["error"].startswith(
        "vllm serve: error: ambiguous option: --max-num could match"), ambiguous
    stats["prefix_flag"] = {r["name"]: r["error"] or "parsed" for r in answer["results"]}

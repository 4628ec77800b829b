"""The engine venv install's progress (gpufleet/host/pip_progress.py): pip's output passes
through, its exit code is the program's, and the status file says how many of the lock's
wheels are fetched, their bytes, the rate and the time left, then done or failed; a
status whose process is gone says so. Runs under every host Python (scripts/host-pythons)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "gpufleet" / "host" / "pip_progress.py"

LOCK = textwrap.dedent("""\
    # a lock as scripts/lock writes it
    torch==2.9.0 \\
        --hash=sha256:aaaa
    numpy==2.3.4 \\
        --hash=sha256:bbbb
    vllm==0.33.0 \\
        --hash=sha256:cccc
    """)

# what pip prints off a terminal: the resolution (metadata), then the wheels, then install
PIP_OUTPUT = [
    "Collecting torch==2.9.0 (from -r lock.txt (line 2))",
    "  Downloading torch-2.9.0-cp311-cp311-manylinux_2_28_x86_64.whl.metadata (30 kB)",
    "Collecting numpy==2.3.4 (from -r lock.txt (line 4))",
    "  Using cached numpy-2.3.4-cp311-cp311-manylinux_2_28_x86_64.whl.metadata (62 kB)",
    "Collecting vllm==0.33.0 (from -r lock.txt (line 6))",
    "  Downloading vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl.metadata (15 kB)",
    "Downloading torch-2.9.0-cp311-cp311-manylinux_2_28_x86_64.whl (899.7 MB)",
    "STEP",
    "Using cached numpy-2.3.4-cp311-cp311-manylinux_2_28_x86_64.whl (16.6 MB)",
    "Downloading vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl (400.5 MB)",
    "STEP",
    "Installing collected packages: torch, numpy, vllm",
    "STEP",
    "Successfully installed numpy-2.3.4 torch-2.9.0 vllm-0.33.0",
]


def fake_pip(tmp_path, rc=0):
    """A pip that prints PIP_OUTPUT, waiting at each STEP until the test lets it go."""
    gate = tmp_path / "gate"
    script = tmp_path / "pip.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys, time
        for i, line in enumerate({PIP_OUTPUT!r}):
            if line == "STEP":
                while not os.path.exists({str(gate)!r} + str(i)):
                    time.sleep(0.01)
                continue
            print(line, flush=True)
        sys.stderr.write("an error line\\n")
        sys.exit({rc})
        """))
    return [sys.executable, str(script)], gate


def status(path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--status", str(path)],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out)


def wait_for(path, check, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        got = status(path)
        if check(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def test_the_wheels_fetched_their_bytes_then_done(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text(LOCK)
    state = tmp_path / "status" / "vllm.json"
    command, gate = fake_pip(tmp_path)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--status-file", str(state),
                             "--lock", str(lock), "--name", "vllm venv", "--interval", "0",
                             "--", *command], stdout=subprocess.PIPE, text=True)
    try:
        steps(proc, state, tmp_path)
    finally:  # a failed step leaves no fake pip waiting at its gate
        for step in (7, 10, 12):
            (tmp_path / f"gate{step}").touch()
        proc.kill()
        proc.wait()


def steps(proc, state, tmp_path):
    # the first wheel is on its way: none done yet, the metadata did not count
    first = wait_for(state, lambda s: s.get("files") == 3 and s["state"] == "running")
    assert first["files_done"] == 0 and first["bytes_done"] == 0, first
    assert first["repo"] == "vllm venv" and first["pid"] == proc.pid
    (tmp_path / "gate7").touch()
    # torch fetched (its bytes), numpy from the cache, vllm on its way
    second = wait_for(state, lambda s: s["files_done"] == 2)
    assert second["bytes_done"] == round(899.7e6), second  # the cached wheel: no bytes moved
    assert second["eta_s"] is not None and second["rate_bytes_s"] > 0
    (tmp_path / "gate10").touch()
    installing = wait_for(state, lambda s: s["state"] == "installing")
    assert installing["files_done"] == 3 and installing["eta_s"] is None
    (tmp_path / "gate12").touch()
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert "Successfully installed" in out and "an error line" in out  # merged, passed on
    done = status(state)
    assert done["state"] == "done" and done["bytes_done"] == round(899.7e6 + 400.5e6)


def test_pips_failure_is_the_programs(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text(LOCK)
    state = tmp_path / "s.json"
    command, gate = fake_pip(tmp_path, rc=1)
    for step in (7, 10, 12):
        (tmp_path / f"gate{step}").touch()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--status-file", str(state), "--lock",
                           str(lock), "--", *command], stdout=subprocess.PIPE,
                          text=True, timeout=30)
    assert proc.returncode == 1 and "an error line" in proc.stdout
    assert status(state)["state"] == "failed"


def test_a_status_not_written_yet_or_whose_process_is_gone(tmp_path):
    assert status(tmp_path / "absent.json") == {"state": "starting"}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"state": "running", "pid": dead.pid,
                                "host": os.uname()[1]}))
    assert status(path)["state"] == "gone"

"""The engine runtime's fetches and their progress (gpufleet/host/fetch_progress.py).

The venv install: pip's output passes through, its exit code is the program's, and the
status file says how many of the lock's wheels are fetched, their bytes, the rate and the
time left, then done or failed. The image pull: podman runs on a terminal (it draws its
layers' bars only there), the status file has the layers' bytes and sizes, the output
passed on is podman's lines without the bars. A status whose process is gone says so.
Runs under every host Python (scripts/host-pythons)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "gpufleet" / "host" / "fetch_progress.py"

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


# podman pull on a terminal (containers/image's bars, mpb redrawing them in place: cursor
# up, clear, every bar again); off a terminal it prints "Copying blob sha256:..." only
PODMAN = textwrap.dedent("""\
    import os, sys, time
    gate = sys.argv[1]
    out = sys.stderr
    if not out.isatty():
        out.write("Copying blob sha256:30babffc8f09aaaa\\nnot a terminal\\n")
        sys.exit(3)
    out.write("Trying to pull lab:5000/vllm:glm53...\\nGetting image source signatures\\n")
    def frame(bars, first=False):
        if not first:
            out.write("\\x1b[%dA\\x1b[J" % len(bars))
        out.write("".join(b + "\\n" for b in bars))
        out.flush()
    def wait(step):
        while not os.path.exists(gate + step):
            time.sleep(0.01)
    frame(["Copying blob 30babffc8f09 [>-----------] 0.0b / 100.0MiB",
           "Copying blob 9a6a76c6ae5f skipped: already exists"], first=True)
    frame(["Copying blob 30babffc8f09 [===>--------] 25.0MiB / 100.0MiB",
           "Copying blob 9a6a76c6ae5f skipped: already exists"])
    wait("1")
    frame(["Copying blob 30babffc8f09 done",
           "Copying blob 9a6a76c6ae5f skipped: already exists",
           "Copying blob 5e1c0ffee123 [=====>------] 1.5GiB / 3.0GiB"])
    wait("2")
    frame(["Copying blob 30babffc8f09 done",
           "Copying blob 9a6a76c6ae5f skipped: already exists",
           "Copying blob 5e1c0ffee123 done",
           "Copying config 0123456789ab [--------------] 0.0b / 1.2KiB"])
    frame(["Copying blob 30babffc8f09 done",
           "Copying blob 9a6a76c6ae5f skipped: already exists",
           "Copying blob 5e1c0ffee123 done",
           "Copying config 0123456789ab done"])
    out.write("Writing manifest to image destination\\nError: a last line\\n" if sys.argv[2] != "0"
              else "Writing manifest to image destination\\nStoring signatures\\n")
    sys.exit(int(sys.argv[2]))
    """)


def pull(tmp_path, state, rc=0, interval="0"):
    script = tmp_path / "podman.py"
    script.write_text(PODMAN)
    return subprocess.Popen([sys.executable, str(SCRIPT), "--status-file", str(state), "--pull",
                             "--name", "vllm image", "--interval", interval, "--",
                             sys.executable, str(script), str(tmp_path / "gate"), str(rc)],
                            stdout=subprocess.PIPE, text=True)


def test_an_image_pull_by_its_layers_bytes(tmp_path):
    state = tmp_path / "pull.json"
    proc = pull(tmp_path, state)
    try:
        # a quarter of the first layer; the skipped one counts as done, with no bytes
        first = wait_for(state, lambda s: s.get("bytes_done") == 25 * 2 ** 20)
        assert first["unit"] == "layers" and first["repo"] == "vllm image"
        assert (first["files_done"], first["files"]) == (1, 2), first
        assert first["bytes_total"] == 100 * 2 ** 20 and first["eta_s"] is not None
        (tmp_path / "gate1").touch()
        # a third layer starts: the total grows by its size
        second = wait_for(state, lambda s: s["files"] == 3)
        assert second["bytes_total"] == 100 * 2 ** 20 + 3 * 2 ** 30, second
        assert second["bytes_done"] == 100 * 2 ** 20 + round(1.5 * 2 ** 30), second
        assert second["files_done"] == 2
        (tmp_path / "gate2").touch()
        out, _ = proc.communicate(timeout=10)
    finally:
        for step in "12":
            (tmp_path / f"gate{step}").touch()
        proc.kill()
        proc.wait()
    assert proc.returncode == 0
    done = status(state)
    assert done["state"] == "done" and done["files_done"] == done["files"] == 3
    assert done["bytes_done"] == done["bytes_total"] == 100 * 2 ** 20 + 3 * 2 ** 30
    # podman's lines, each layer's start and end once, the config's end, no bar, no escape
    assert out.splitlines() == [
        "Trying to pull lab:5000/vllm:glm53...", "Getting image source signatures",
        "Copying blob 30babffc8f09", "Copying blob 9a6a76c6ae5f skipped: already exists",
        "Copying blob 30babffc8f09 done", "Copying blob 5e1c0ffee123",
        "Copying blob 5e1c0ffee123 done", "Copying config 0123456789ab done",
        "Writing manifest to image destination",
        "Storing signatures"], out


def test_a_failed_pull_is_the_programs_with_its_last_lines(tmp_path):
    state = tmp_path / "pull.json"
    for step in "12":
        (tmp_path / f"gate{step}").touch()
    proc = pull(tmp_path, state, rc=125, interval="5")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 125
    assert out.splitlines()[-1] == "Error: a last line"
    assert status(state)["state"] == "failed"


def test_the_command_and_one_kind_are_required(tmp_path):
    for args in ([], ["--pull"], ["--pull", "--lock", "l", "--", "true"], ["--", "true"]):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--status-file",
                               str(tmp_path / "s"), *args], stderr=subprocess.PIPE, text=True)
        assert proc.returncode == 2 and "one of --lock or --pull" in proc.stderr, args

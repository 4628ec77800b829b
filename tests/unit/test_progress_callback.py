"""The gpufleet stdout callback: a task marked gpufleet_progress shows its `until` polls
as progress (bytes, rate, ETA), every other task keeps Ansible's default output."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# loaded under its own name: the plugin's file name would shadow the gpufleet package
_spec = importlib.util.spec_from_file_location(
    "gpufleet_callback", ROOT / "gpufleet" / "ansible_plugins" / "callback" / "gpufleet.py")
_callback = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_callback)
progress_line = _callback.progress_line

pytestmark = pytest.mark.timeout(120)

PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: A download that reports as it goes
      vars:
        gpufleet_progress: true
      ansible.builtin.command:
        argv: [{python}, -c, "{script}", {counter}]
      register: st
      until: (st.stdout | from_json).state == 'done'
      retries: 5
      delay: 0
      changed_when: false
    - name: A plain poll
      ansible.builtin.command: "true"
      register: plain
      until: plain is not skipped and (plain.attempts | default(1)) > 1
      retries: 2
      delay: 0
      changed_when: false
"""

# a status without a total yet (resolving), then 0 %, 33 %, done
SCRIPT = (
    "import json,sys,pathlib;p=pathlib.Path(sys.argv[1]);n=int(p.read_text() or 0) "
    "if p.exists() else 0;p.write_text(str(n+1));m=n-1;print(json.dumps({'state': 'done' "
    "if n>=3 else 'running','repo':'zai-org/GLM-5.3-Flash','bytes_done':max(m,0)*3*2**30,"
    "'bytes_total':9*2**30 if n else 0,'rate_bytes_s':2**30,'eta_s':(3-m)*3,'files_done':"
    "max(m,0),'files':3}))"
)


def test_progress_polls_show_bytes_rate_and_eta_instead_of_retrying(tmp_path):
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(python=sys.executable, script=SCRIPT,
                                counter=tmp_path / "n"))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    env.pop("ANSIBLE_STDOUT_CALLBACK", None)
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,",
         "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=100)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # off a terminal: a plain line when it starts, the first figures at once, then at most
    # one line per 10 s (so not the 33 % of the next poll)
    assert "progress: localhost: zai-org/GLM-5.3-Flash: starting" in out
    assert "progress: localhost: zai-org/GLM-5.3-Flash:   0.0% 0 B of 9.0 GiB, 1.0 GiB/s, " \
        "9 s left, 0/3 files" in out
    assert "33.3%" not in out and out.count("progress: ") == 2
    assert "FAILED - RETRYING: [localhost]: A download" not in out
    # every other task keeps the default callback's retry lines and recap
    assert "FAILED - RETRYING: [localhost]: A plain poll" in out
    assert "localhost                  : ok=2" in out


def test_under_ansible_runner_the_progress_is_plain_lines_too(tmp_path):
    """AWX runs the plays through ansible-runner on a pseudo-terminal, its own callback
    wrapped around the one ANSIBLE_STDOUT_CALLBACK names: with the execution environment's
    settings (execution-environment.yml) the job's log shows the same plain progress lines,
    no bar and no FAILED - RETRYING for the download."""
    import ansible_runner
    import yaml

    steps = yaml.safe_load((ROOT / "execution-environment.yml").read_text())[
        "additional_build_steps"]["append_final"]
    ee = {k: v.replace("/runner/project", str(ROOT)) for k, v in
          (s[len("ENV "):].split("=", 1) for s in steps if s.startswith("ENV "))}
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "play.yml").write_text(PLAY.format(
        python=sys.executable, script=SCRIPT, counter=tmp_path / "n"))
    run = ansible_runner.run(
        private_data_dir=str(tmp_path), playbook="play.yml", inventory="localhost,",
        quiet=True, cmdline=f"-c local -e ansible_python_interpreter={sys.executable}",
        envvars={"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                 "ANSIBLE_LOCALHOST_WARNING": "0",
                 # the collection, as the project's ansible.cfg names it
                 "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), **ee})
    out = run.stdout.read()
    assert (run.status, run.rc) == ("successful", 0), out
    assert "progress: localhost: zai-org/GLM-5.3-Flash:   0.0% 0 B of 9.0 GiB" in out
    assert "\x1b[K[" not in out  # no bar
    assert "FAILED - RETRYING: [localhost]: A download" not in out
    assert "FAILED - RETRYING: [localhost]: A plain poll" in out


@pytest.mark.parametrize(("status", "line", "frac"), [
    ({}, "h: download: starting", None),
    ({"state": "running", "repo": "r/m", "bytes_total": 0}, "h: r/m: starting", None),
    ({"state": "running", "repo": "r/m", "bytes_done": 3 * 2**40, "bytes_total": 4 * 2**40,
      "rate_bytes_s": 500 * 2**20, "eta_s": 3725, "files_done": 7, "files": 9},
     "h: r/m:  75.0% 3.0 TiB of 4.0 TiB, 500.0 MiB/s, 1 h 02 m left, 7/9 files", 0.75),
    ({"state": "running", "repo": "r/m", "bytes_done": 10, "bytes_total": 100, "eta_s": None},
     "h: r/m:  10.0% 10 B of 100 B, 0 B/s, ? left, 0/0 files", 0.1),
    # a venv's lock (fetch_progress.py): no byte total, so by files
    ({"state": "running", "repo": "vllm venv", "bytes_done": 3 * 2**30, "files_done": 29,
      "files": 145, "rate_bytes_s": 40 * 2**20, "eta_s": 130},
     "h: vllm venv:  20.0% 29/145 files, 3.0 GiB fetched, 40.0 MiB/s, 2 m 10 s left", 0.2),
    ({"state": "installing", "repo": "vllm venv", "files_done": 145, "files": 145},
     "h: vllm venv: 145 files fetched, installing", 1.0),
    # an image's layers (fetch_progress.py --pull): by bytes, counted in layers
    ({"state": "running", "repo": "vllm image", "unit": "layers", "bytes_done": 2**30,
      "bytes_total": 4 * 2**30, "rate_bytes_s": 2**28, "eta_s": 12, "files_done": 3,
      "files": 7},
     "h: vllm image:  25.0% 1.0 GiB of 4.0 GiB, 256.0 MiB/s, 12 s left, 3/7 layers", 0.25),
])
def test_progress_line(status, line, frac):
    assert progress_line("h", status) == (line, frac)

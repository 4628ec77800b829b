"""The dry parse on a lab host: the installed stand-in engine's own parser, before any change.

One deployment of h200-pd-1node (so lab1 has its vLLM venv), then:
- preflight again: the plan's engine command lines go through the installed engine's
  parser on lab1 and pass;
- the common role's dry parse (tasks_from: dry_parse, as the installing role calls it)
  with a decode command line carrying a flag vLLM does not take: refused with vLLM's own
  message naming the flag, the process and the fix, and no file on any host changed.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from labutil import BIN, ENV, ROOT, digests, fab, playbook, recap

from gpufleet.model import host_slices

pytestmark = pytest.mark.lab

TARGET = "h200-pd-1node"
VENV = "/opt/gpufleet/engines/vllm-0.33.0"


@pytest.fixture(scope="module")
def deployed(lab):
    proc = fab("deploy", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return lab


def test_preflight_parses_the_installed_engines_command_lines(deployed):
    proc = playbook("playbooks/preflight.yml", "-e", f"gpufleet_target={TARGET}")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert _ran_on_lab1(proc.stdout), proc.stdout[-3000:]


def _plan() -> dict:
    return json.loads(fab("plan", "--target", TARGET, "-i", "inventories/lab", "--format",
                          "json").stdout)


def _ran_on_lab1(output: str) -> bool:
    block = output.split("Each engine command line through the installed engine's parser")[1]
    return "ok: [lab1]" in block.split("TASK [")[0]


def _dry_parse(tmp_path, processes: list[dict]) -> subprocess.CompletedProcess:
    plan = _plan()
    (tmp_path / "vars.json").write_text(json.dumps(
        {"gpufleet_host": host_slices(plan)["lab1"],
         "common_dry_parse_processes": processes}))
    (tmp_path / "dry_parse.yml").write_text(
        "- hosts: lab1\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role:\n        name: gpufleet.fleet.common\n"
        "        tasks_from: dry_parse\n")
    return subprocess.run(
        [str(BIN / "ansible-playbook"), str(tmp_path / "dry_parse.yml"),
         "-e", f"@{tmp_path / 'vars.json'}"], cwd=ROOT, capture_output=True, text=True,
        env=ENV, timeout=600, check=False)


def test_a_flag_the_installed_engine_refuses_stops_the_host_unchanged(deployed, tmp_path):
    plan = _plan()
    decode = next(p for p in plan["processes"] if p["name"] == "decode")
    assert decode["argv"][0] == f"{VENV}/bin/vllm"

    good = _dry_parse(tmp_path, [decode])
    assert good.returncode == 0, good.stdout[-3000:]
    assert _ran_on_lab1(good.stdout), good.stdout[-3000:]
    assert recap(good.stdout)["lab1"]["changed"] == 0

    before = digests()
    bad = _dry_parse(tmp_path, [{**decode, "argv": decode["argv"] + ["--max-num-seq", "8"]}])
    assert bad.returncode != 0
    assert (f"process decode: vllm 0.33.0 in {VENV} refuses its command line: vllm serve: "
            "error: unrecognized arguments: --max-num-seq. Fix: correct or remove that flag"
            ) in " ".join(bad.stdout.split()), bad.stdout[-3000:]
    assert digests() == before

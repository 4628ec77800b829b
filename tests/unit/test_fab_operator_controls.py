"""Operator controls.

`fab --list` shows each task's first docstring line, a whole sentence. --purge-cache asks
first. Ansible's own options go through fab: --limit, -v, -e and --ask-become-pass reach
ansible-playbook as given (the plan's file last, so it wins). -e of a variable the plan
reads is refused, since it would reach the roles but not the plan, and so is a secret
given inline. --ask-vault-pass asks once, and the inventory read and the run both decrypt
with it, from a private file that is gone afterwards. fab's own parser reads the command
lines (invoke's Program) and the real ansible-inventory reads the inventories; only
ansible-playbook is recorded, not run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from invoke import Program

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SAMPLE = str(REPO / "inventories" / "sample")
from gpufleet import tasks  # noqa: E402


class Calls(list):
    run = None


@pytest.fixture
def runs(monkeypatch, tmp_path):
    """fab's tasks in this process: ansible-playbook calls are recorded (argv, the vault
    file the environment names and its text), everything else runs."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("ANSIBLE_VAULT_PASSWORD_FILE", raising=False)
    real = subprocess.run
    calls = Calls()

    def run(cmd, *args, **kwargs):
        if Path(cmd[0]).name != "ansible-playbook":
            return real(cmd, *args, **kwargs)
        vault = kwargs["env"].get("ANSIBLE_VAULT_PASSWORD_FILE")
        calls.append({"argv": cmd, "vault": vault,
                      "password": Path(vault).read_text() if vault else None,
                      "extra": json.loads(Path(next(
                          a for a in cmd if "gpufleet-plan-" in a)[1:]).read_text())})
        return subprocess.CompletedProcess(cmd, 0, getattr(run, "stdout", ""), "")

    monkeypatch.setattr(tasks.subprocess, "run", run)
    calls.run = run
    return calls



def fab(*argv: str) -> int:
    """Run fab's tasks with argv; the exit code (invoke's Exit, or 0)."""
    try:
        Program(namespace=tasks.ns, name="fab").run(["fab", *argv], exit=True)
    except SystemExit as exc:
        return exc.code or 0
    return 0


def test_the_options_reach_ansible_playbook_before_the_plan(runs):
    assert fab("prepare", "-i", SAMPLE, "--limit", "gpu-node1", "-vv",
               "-e", "nvidia_driver_install=true", "-e", '{"rdma_install": true}',
               "--ask-become-pass") == 0
    argv = runs[0]["argv"]
    plan_file = argv.index("-e", argv.index("-e", argv.index("-e") + 1) + 1)
    # the hosts the pattern matched, and localhost, where the plan and the record plays run
    assert argv[argv.index("--limit") + 1] == "gpu-node1,localhost" and "-vv" in argv
    assert argv[argv.index("-e") + 1] == "nvidia_driver_install=true"
    assert "--ask-become-pass" in argv
    assert argv[plan_file + 1].startswith("@") and plan_file == len(argv) - 2


def test_without_options_nothing_is_added(runs):
    assert fab("prepare", "-i", SAMPLE) == 0
    argv = runs[0]["argv"]
    assert not {"--limit", "--ask-become-pass"} & set(argv)
    assert [a for a in argv if a.startswith("-v")] == [] and argv.count("-e") == 1


@pytest.mark.parametrize("value, said", [
    ("gpufleet_runtime=image gpufleet_workers={}", "gpufleet_runtime, gpufleet_workers: the plan"),
    ('{"gpufleet_target": "h200-agg"}', "gpufleet_target: the plan reads this"),
    ("gpufleet_plan_json=x", "gpufleet_plan_json: the plan reads this"),
    ("@/nonexistent/vars.yml", "cannot read /nonexistent/vars.yml"),
    ("just-words", "give KEY=VALUE, a YAML or JSON mapping, or @FILE"),
    ("gpufleet_hf_token=hf_abc", "gpufleet_hf_token: a secret on the command line"),
    ('{"registry_password": "x"}', "registry_password: a secret on the command line"),
])
def test_a_wrong_extra_var_is_refused_before_anything_runs(runs, capsys, value, said):
    assert fab("deploy", "--target", "h200-pd-1node", "-i", SAMPLE, "-e", value) == 2
    assert said in capsys.readouterr().err and runs == []


def test_an_extra_vars_file_is_read_for_its_names(runs, capsys, tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("gpufleet_runtime: image\n")
    good = tmp_path / "good.yml"
    good.write_text("nvidia_driver_install: true\nregistry_password: !vault |\n"
                    "  $ANSIBLE_VAULT;1.1;AES256\n  6162\n")  # a vaulted value: names read
    assert fab("prepare", "-i", SAMPLE, "-e", f"@{bad}") == 2
    assert "gpufleet_runtime: the plan reads this" in capsys.readouterr().err
    assert fab("prepare", "-i", SAMPLE, "-e", f"@{good}") == 0
    assert f"@{good}" in runs[0]["argv"]


def test_a_limit_that_matches_no_host_of_the_deployment_is_refused(runs, capsys):
    assert fab("status", "-i", SAMPLE, "--limit", "") == 2
    assert "give a host pattern" in capsys.readouterr().err and runs == []
    assert fab("prepare", "-i", SAMPLE, "--limit", "nosuchhost") == 2
    assert "--limit 'nosuchhost' matches none of the deployment's hosts (gpu-node1)" in \
        capsys.readouterr().err and runs == []
    assert fab("prepare", "-i", SAMPLE, "--limit", "workers") == 0  # a group: its hosts
    assert "gpu-node1,localhost" in runs[-1]["argv"]


def test_a_limited_run_still_plans_on_the_controller(tmp_path):
    """The real fab and ansible-playbook: the plan play runs on localhost, which a plain
    --limit would skip (and every later play with it), so a limited status reports the
    host it names, and the one it leaves out is not named as a host that reported nothing.
    The host is this machine (a local connection); status only reads."""
    inventory = tmp_path / "inv"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(
        "all:\n  children:\n    workers:\n      hosts:\n"
        "        here: {ansible_connection: local, "
        f"ansible_python_interpreter: {sys.executable}}}\n"
        "        there: {ansible_host: 192.0.2.99}\n")
    (inventory / "group_vars" / "all.yml").write_text(
        "gpufleet_target: h200-pd-1node\ngpufleet_hardware: h200\ngpufleet_replicas: true\n")
    proc = subprocess.run([sys.executable, "-m", "gpufleet", "status", "-i", str(inventory),
                           "--limit", "here"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")})
    assert re.search(r"^here +gpufleet-prefill\.service", proc.stdout, re.M), \
        proc.stdout + proc.stderr
    assert "there" not in proc.stdout


def test_the_vault_password_is_asked_once_and_serves_the_inventory_and_the_run(
        runs, monkeypatch, tmp_path):
    """A group_vars file encrypted whole: the plan needs it (ansible-inventory decrypts it
    with the password), and so does the run; the password is in neither's argv and its
    file is gone once the task ends."""
    inventory = tmp_path / "inv"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text((Path(SAMPLE) / "hosts.yml").read_text())
    secret = inventory / "group_vars" / "all.yml"
    secret.write_text("gpufleet_target: h200-pd-1node\ngpufleet_hardware: h200\n")
    password = tmp_path / "pw"
    password.write_text("s3cret-vault-pass\n")
    subprocess.run([str(BIN / "ansible-vault"), "encrypt", "--vault-password-file",
                    str(password), str(secret)], check=True, capture_output=True)
    assert secret.read_text().startswith("$ANSIBLE_VAULT")
    asked = []
    monkeypatch.setattr(tasks.getpass, "getpass",
                        lambda prompt: asked.append(prompt) or "s3cret-vault-pass")

    assert fab("prepare", "-i", str(inventory)) == 2  # no password: the plan cannot read it
    assert fab("prepare", "-i", str(inventory), "--ask-vault-pass") == 0
    assert asked == ["Vault password: "]
    call = runs[-1]
    assert call["password"] == "s3cret-vault-pass\n"
    assert "s3cret-vault-pass" not in " ".join(call["argv"])
    assert not Path(call["vault"]).exists()
    assert "ANSIBLE_VAULT_PASSWORD_FILE" not in os.environ


def test_every_task_that_runs_a_playbook_takes_the_options():
    """The tasks that run a playbook take Ansible's options; those that read the inventory
    take the vault password; fab targets neither."""
    for name, t in tasks.ns.tasks.items():
        opts = {a.name for a in t.get_arguments()}
        if name in ("targets",):
            assert "ask_vault_pass" not in opts
        elif name in ("plan", "endpoint", "monitoring", "bench"):
            assert "ask_vault_pass" in opts and "limit" not in opts, name
        else:
            assert set(tasks.ANSIBLE_OPTIONS) <= opts, name


def test_status_with_a_limit_expects_only_the_hosts_it_was_given(runs, tmp_path, capsys):
    """Two replicas; --limit node1: the run reports node1 only, and node2 is not named as a
    host that reported nothing (without --limit it is)."""
    inventory = tmp_path / "inv"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(
        "all:\n  children:\n    workers:\n      hosts:\n"
        "        node1: {ansible_host: 192.0.2.1}\n        node2: {ansible_host: 192.0.2.2}\n")
    (inventory / "group_vars" / "all.yml").write_text(
        "gpufleet_target: h200-pd-1node\ngpufleet_hardware: h200\ngpufleet_replicas: true\n")
    unit = {"unit": "gpufleet-decode.service", "role": "decode", "active": "active",
            "sub": "running", "uptime_s": 60, "restarts": 0, "ready": True}
    runs.run.stdout = json.dumps({"custom_stats": {"node1": {"gpufleet_report": {
        "units": [unit]}}}, "stats": {"node1": {}}})
    assert fab("status", "-i", str(inventory), "--limit", "node1") == 0
    assert "node2" not in capsys.readouterr().out
    assert fab("status", "-i", str(inventory)) == 1
    assert "node2: unreachable, failed or reported nothing" in capsys.readouterr().out


def test_purge_cache_asks_first(runs, monkeypatch, capsys):
    """--purge-cache deletes a download of hundreds of GiB: without a terminal it needs
    --yes, on one it asks and only yes goes on; --check neither asks nor changes."""
    assert fab("teardown", "-i", SAMPLE, "--purge-cache") == 2  # stdin is no terminal here
    said = capsys.readouterr().err
    assert "deletes zai-org/GLM-5.3-Flash (306 GiB) from /var/cache/gpufleet/hf on gpu-node1" \
        in said and "Fix: add --yes" in said and runs == []

    monkeypatch.setattr(tasks.sys.stdin, "isatty", lambda: True)
    answers = iter(["n", "y"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    assert fab("teardown", "-i", SAMPLE, "--purge-cache") == 2 and runs == []
    assert fab("teardown", "-i", SAMPLE, "--purge-cache") == 0
    assert runs[-1]["extra"]["teardown_cache"] is True

    monkeypatch.setattr("builtins.input", lambda prompt: pytest.fail("asked"))
    assert fab("teardown", "-i", SAMPLE, "--purge-cache", "--yes") == 0
    assert fab("teardown", "-i", SAMPLE, "--purge-cache", "--check") == 0
    assert runs[-1]["argv"][-2:] == ["--check", "--diff"]
    assert fab("teardown", "-i", SAMPLE) == 0 and runs[-1]["extra"]["teardown_cache"] is False


def test_fab_list_shows_a_whole_sentence_per_task():
    """invoke's --list prints a docstring's first line: it must be a sentence of its own
    (the summary, then a blank line before any detail)."""
    for coll in (tasks.ns, *tasks.ns.collections.values()):
        for name, t in coll.tasks.items():
            lines = (t.body.__doc__ or "").strip().splitlines()
            assert lines and lines[0].endswith("."), f"{name}: {lines[:1]}"
            assert len(lines) == 1 or not lines[1].strip(), \
                f"{name}: the summary runs on into a second line: {lines[:2]}"


def test_an_inventory_path_is_read_from_where_fab_was_started(runs, monkeypatch, tmp_path):
    """fab from another directory: -i relative to that directory (an operator's own
    inventory), or to the checkout (inventories/h200); ansible-playbook, which runs in the
    checkout, gets the absolute path."""
    mine = tmp_path / "mysite"
    shutil.copytree(SAMPLE, mine)
    monkeypatch.chdir(tmp_path)
    assert fab("prepare", "-i", "mysite") == 0
    argv = runs[-1]["argv"]
    assert argv[argv.index("-i") + 1] == str(mine)
    assert fab("prepare", "-i", "inventories/sample") == 0
    argv = runs[-1]["argv"]
    assert argv[argv.index("-i") + 1] == SAMPLE

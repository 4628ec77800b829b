"""`fab logs -f`'s follower (gpufleet/follow.py): the SSH command Ansible's connection
variables make, sudo only for a user other than root, a local connection without SSH, and
the lines of every host at once, each led by its host, with a host whose command failed
named."""

from __future__ import annotations

import io
import shlex
import sys
from pathlib import Path

from gpufleet import follow

LAB = {"ansible_host": "10.213.77.11", "ansible_user": "root",
       "ansible_ssh_private_key_file": "/var/lib/gpufleet-lab/ssh/id_ed25519",
       "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"}


def test_ssh_as_ansible_connects():
    argv = follow.command("lab1", dict(LAB, ansible_port=2222), ["gpufleet-decode.service"], 5,
                          ["-o", "ServerAliveInterval=5"])
    assert argv[:3] == ["ssh", "-o", "BatchMode=yes"]
    assert argv[argv.index("-i") + 1] == LAB["ansible_ssh_private_key_file"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "root"
    assert "StrictHostKeyChecking=no" in argv and "ServerAliveInterval=5" in argv
    host, dashes, remote = argv[-3:]
    assert host == "10.213.77.11" and dashes == "--"
    assert shlex.split(remote) == ["journalctl", "--follow", "--no-hostname", "--output",
                                   "short-iso", "--lines", "5", "--unit",
                                   "gpufleet-decode.service"]


def test_a_user_other_than_root_reads_through_sudo():
    argv = follow.command("n1", dict(LAB, ansible_user="alice"), ["u.service"], 1, [])
    assert shlex.split(argv[-1])[:2] == ["sudo", "-n"]


def test_a_local_connection_runs_here(monkeypatch):
    monkeypatch.setattr(follow.getpass, "getuser", lambda: "root")
    argv = follow.command("here", {"ansible_connection": "local"}, ["a.service", "b.service"],
                          3, ["-o", "X=1"])
    assert argv[0] == "journalctl" and argv.count("--unit") == 2 and "ssh" not in argv


def test_ansible_cfgs_ssh_args(tmp_path, monkeypatch):
    monkeypatch.delenv("ANSIBLE_SSH_ARGS", raising=False)
    cfg = tmp_path / "ansible.cfg"
    cfg.write_text("[ssh_connection]\nssh_args = -o ControlMaster=auto -o ServerAliveInterval=5\n")
    assert follow.ssh_args(cfg) == ["-o", "ControlMaster=auto", "-o", "ServerAliveInterval=5"]
    monkeypatch.setenv("ANSIBLE_SSH_ARGS", "-o A=1")
    assert follow.ssh_args(cfg) == ["-o", "A=1"]


def test_every_hosts_lines_led_by_the_host_and_a_failure_named():
    out = io.StringIO()
    failed = follow.follow({
        "lab1": [sys.executable, "-c", "print('one'); print('two')"],
        "lab22": [sys.executable, "-c", "import sys; print('x'); "
                  "sys.exit('Permission denied (publickey)')"],
    }, out=out)
    lines = out.getvalue().splitlines()
    assert sorted(lines) == ["lab1  | one", "lab1  | two", "lab22 | x"]
    assert failed == ["lab22: exit 1: Permission denied (publickey)"]


def test_ctrl_c_ends_every_follower(tmp_path):
    """SIGINT: the followers are terminated and follow returns nothing failed."""
    import signal
    import subprocess
    import time

    pidfile = tmp_path / "pid"
    shell = f"echo $$ > {pidfile}; echo up; exec sleep 60"
    script = ("from gpufleet import follow; "
              f"print(follow.follow({{'h': ['sh', '-c', {shell!r}]}}), flush=True)")
    # Ctrl-C as a terminal sends it: the child's SIGINT at its default, which Python turns
    # into KeyboardInterrupt (a run started in the background inherits it ignored)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "h | up\n"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0 and proc.stdout.read() == "[]\n"
    pid = int(pidfile.read_text())
    stat = Path(f"/proc/{pid}/stat")

    def gone() -> bool:  # gone, or dead unreaped
        try:
            return stat.read_text().split()[2] == "Z"
        except OSError:
            return True
    end = time.time() + 5  # polled: a loaded machine may take a while to deliver the signal
    while not gone() and time.time() < end:
        time.sleep(0.05)
    assert gone()

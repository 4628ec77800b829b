"""`fab logs -f`: the deployment's units' journals as they are written, from every host at
once, each line led by its host's inventory name.

One `journalctl --follow` per host, over SSH with the connection the inventory gives Ansible
(the host's address, user, port, key and SSH arguments, with ansible.cfg's own), or on this
machine for a host with a local connection. A user other than root reads the journal
through `sudo -n`. Ctrl-C ends every follower.
"""

from __future__ import annotations

import configparser
import getpass
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path


def ssh_args(config: Path) -> list[str]:
    """The SSH arguments Ansible adds to every connection: ANSIBLE_SSH_ARGS, else
    ansible.cfg's [ssh_connection] ssh_args."""
    if os.environ.get("ANSIBLE_SSH_ARGS"):
        return shlex.split(os.environ["ANSIBLE_SSH_ARGS"])
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(config)
    return shlex.split(parser.get("ssh_connection", "ssh_args", fallback=""))


def command(name: str, hostvars: dict, units: list[str], lines: int,
            base_ssh_args: list[str]) -> list[str]:
    """The command that follows UNITS' journal on the host NAME (its inventory variables
    HOSTVARS)."""
    local = hostvars.get("ansible_connection") == "local"
    user = str(hostvars.get("ansible_user") or getpass.getuser())
    journal = ["journalctl", "--follow", "--no-hostname", "--output", "short-iso",
               "--lines", str(lines), *(a for u in units for a in ("--unit", u))]
    if (getpass.getuser() if local else user) != "root":
        journal = ["sudo", "-n", *journal]
    if local:
        return journal
    argv = ["ssh", "-o", "BatchMode=yes", *base_ssh_args,
            *shlex.split(str(hostvars.get("ansible_ssh_common_args") or "")),
            *shlex.split(str(hostvars.get("ansible_ssh_extra_args") or ""))]
    if hostvars.get("ansible_ssh_private_key_file"):
        argv += ["-i", str(hostvars["ansible_ssh_private_key_file"])]
    if hostvars.get("ansible_port"):
        argv += ["-p", str(hostvars["ansible_port"])]
    host = str(hostvars.get("ansible_host") or name)
    return [*argv, "-l", user, host, "--", shlex.join(journal)]


def follow(commands: dict[str, list[str]], out=sys.stdout) -> list[str]:
    """Run each host's command and print its lines as they come, led by the host, until
    every one has ended or Ctrl-C; returns a line per host whose command failed."""
    lock = threading.Lock()
    width = max(len(h) for h in commands)
    procs: dict[str, subprocess.Popen] = {}
    failed: list[str] = []

    def pump(host: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with lock:
                print(f"{host.ljust(width)} | {line.rstrip()}", file=out, flush=True)
        if proc.wait() != 0:
            said = proc.stderr.read().strip().splitlines()
            with lock:
                failed.append(f"{host}: exit {proc.returncode}: "
                              f"{said[-1] if said else 'no message'}")

    # Ctrl-C may come as soon as the first line shows, before every follower has started:
    # all of it is inside the try
    try:
        for host, argv in commands.items():
            procs[host] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           stdin=subprocess.DEVNULL, text=True,
                                           errors="replace")
        threads = [threading.Thread(target=pump, args=item, daemon=True)
                   for item in procs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait()
        return []
    return failed

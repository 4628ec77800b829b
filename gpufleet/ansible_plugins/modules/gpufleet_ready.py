"""Ansible module gpufleet_ready: wait until a gpufleet unit really serves."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpufleet_ready
short_description: Wait until a unit's process answers its health endpoint and generates
description:
  - Polls the health URL until it answers 200, then (when given) sends one real one-token
    generation, then proves the answer came from the unit: every socket listening where the
    URL points (its address, or all addresses, at its port) belongs to a process of the
    unit (its cgroup, or a child of one, as a container's processes are of conmon). Fails
    at once, with the unit's state and the last journal lines, when the unit is failed,
    inactive, waiting to restart, or restarted while waited for (a crash loop is not waited
    out), when another process holds the port, and after I(timeout) seconds.
  - Read-only; safe in check mode (it reports what it would wait for).
options:
  unit:
    description: systemd unit of the process.
    type: str
    required: true
  url:
    description: Health URL (200 when up).
    type: str
    required: true
  generate_url:
    description: OpenAI /v1/completions URL (POST one token) or SGLang /health_generate (GET).
    type: str
  served_name:
    description: Model name for the generation request.
    type: str
  timeout:
    description: Seconds to wait in all.
    type: int
    default: 600
  interval:
    description: Seconds between probes.
    type: float
    default: 2
  journal_lines:
    description: Journal lines returned on failure.
    type: int
    default: 40
"""

RETURN = r"""
elapsed:
  description: Seconds until ready.
  type: float
  returned: success
"""

import ipaddress
import json
import os
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

from ansible.module_utils.basic import AnsibleModule


def unit_state(unit, props="ActiveState,SubState,NRestarts,Result"):
    out = subprocess.run(
        ["systemctl", "show", "-p", props, unit],
        capture_output=True, text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal(unit, lines):
    return subprocess.run(
        ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"],
        capture_output=True, text=True, check=False).stdout


LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def _address(hexaddr):
    """An address of /proc/net/tcp{,6}: 32-bit words in the host's byte order."""
    words = [int(hexaddr[i:i + 8], 16) for i in range(0, len(hexaddr), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    addr = ipaddress.ip_address(raw)
    mapped = getattr(addr, "ipv4_mapped", None)
    return mapped or addr


def listeners(port, proc="/proc"):
    """(address, socket inode) of every TCP socket listening on port."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, "net", name)) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            hexaddr, hexport = local.split(":")
            if state == LISTEN and int(hexport, 16) == port:
                out.append((_address(hexaddr), inode))
    return out


def socket_owners(inodes, proc="/proc"):
    """pid -> the socket inodes among inodes that it has open."""
    wanted = {f"socket:[{i}]": i for i in inodes}
    owners = {}
    for pid in (d for d in os.listdir(proc) if d.isdigit()):
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if link in wanted:
                owners.setdefault(int(pid), set()).add(wanted[link])
    return owners


def unit_pids(unit):
    """The unit's main PID and every process in its cgroup (v2, or v1's systemd tree)."""
    show = unit_state(unit, "ControlGroup,MainPID")
    pids = {int(show.get("MainPID") or 0)} - {0}
    group = show.get("ControlGroup") or ""
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/systemd"):
        top = root + group
        if not group or not os.path.isdir(top):
            continue
        for here, _dirs, files in os.walk(top):
            if "cgroup.procs" in files:
                try:
                    with open(os.path.join(here, "cgroup.procs")) as fh:
                        pids.update(int(x) for x in fh.read().split())
                except OSError:
                    pass
        break
    return pids


def _parent(pid, proc="/proc"):
    try:
        with open(os.path.join(proc, str(pid), "stat")) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _describe(pid, proc="/proc"):
    def read(name):
        try:
            with open(os.path.join(proc, str(pid), name), "rb") as fh:
                return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return "?"
    cgroup = (read("cgroup").splitlines() or ["?"])[-1]
    return f"pid {pid} ({read('cmdline')[:120]}; cgroup {cgroup})"


def strangers(unit, url):
    """What holds the socket url reaches other than unit's processes: descriptions of the
    foreign owners; a description of the gap when no socket listens there at all."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or 80
    try:
        want = ipaddress.ip_address(socket.gethostbyname(parts.hostname))
    except (OSError, ValueError):
        return [f"{parts.hostname} does not resolve"]
    socks = [inode for addr, inode in listeners(port)
             if addr == want or addr.is_unspecified]
    if not socks:
        return [f"no socket listens on {want}:{port} on this host"]
    mine = unit_pids(unit)
    out = []
    for pid in sorted(socket_owners(socks)):
        here, steps = pid, 0
        while here > 1 and here not in mine and steps < 64:  # its ancestors, short of init
            here, steps = _parent(here), steps + 1
        if here <= 1 or here not in mine:
            out.append(_describe(pid))
    return out


def probe(url, body=None, timeout=10.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(300).decode(errors="replace")
    except (OSError, ValueError) as exc:
        return None, str(exc)


def main():
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "url": {"type": "str", "required": True},
            "generate_url": {"type": "str"},
            "served_name": {"type": "str"},
            "timeout": {"type": "int", "default": 600},
            "interval": {"type": "float", "default": 2},
            "journal_lines": {"type": "int", "default": 40},
        },
        supports_check_mode=True,
    )
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, msg=f"would wait for {p['unit']} at {p['url']}")
    start = time.monotonic()
    deadline = start + p["timeout"]
    stage, url, body = "health", p["url"], None
    last = ""
    restarts = unit_state(p["unit"]).get("NRestarts", "0")
    while True:
        state = unit_state(p["unit"])
        crashed = state.get("NRestarts", "0") != restarts
        waiting = state.get("SubState") == "auto-restart"
        if crashed or waiting or state.get("ActiveState") in ("failed", "inactive"):
            what = "crashed and was restarted by systemd" if crashed else \
                "crashed and waits to be restarted (activating, auto-restart)" if waiting else \
                f"{state.get('ActiveState')} ({state.get('Result')})"
            module.fail_json(
                msg=f"{p['unit']} {what} while waiting for {stage}",
                unit_state=state, journal=journal(p["unit"], p["journal_lines"]))
        status, last = probe(url, body)
        if status == 200:
            if stage == "generate" or not p["generate_url"]:
                others = strangers(p["unit"], p["url"])
                if others:
                    module.fail_json(
                        msg=f"{p['url']} answered, but not (only) from {p['unit']}: "
                            f"{'; '.join(others)}. Fix: stop what holds the port, or move "
                            "the plan's port (gpufleet_ports)",
                        unit_state=state, journal=journal(p["unit"], p["journal_lines"]))
                module.exit_json(changed=False, elapsed=round(time.monotonic() - start, 1))
            stage, url = "generate", p["generate_url"]
            if not url.endswith("/health_generate"):
                body = {"model": p["served_name"], "prompt": "ping", "max_tokens": 1}
            continue
        if time.monotonic() > deadline:
            module.fail_json(
                msg=f"{p['unit']} did not answer {stage} at {url} within {p['timeout']} s "
                    f"(last: {status or last})",
                unit_state=state, journal=journal(p["unit"], p["journal_lines"]))
        time.sleep(p["interval"])


if __name__ == "__main__":
    main()

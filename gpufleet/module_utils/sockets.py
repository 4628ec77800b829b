"""Who holds a TCP port on this host: the listening sockets of /proc/net/tcp{,6}, the
processes that have them open, and the systemd unit each process belongs to. Stdlib only
(the Ansible modules gpufleet_ready and gpufleet_port_holders run it on every host Python).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import subprocess
import urllib.parse

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


def _show(unit, props):
    out = subprocess.run(["systemctl", "show", "-p", props, unit], capture_output=True,
                         text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def unit_pids(unit):
    """The unit's main PID and every process in its cgroup (v2, or v1's systemd tree)."""
    show = _show(unit, "ControlGroup,MainPID")
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




def unit_of(pid, proc="/proc"):
    """The systemd service a process runs in (the last .service of its cgroup path), or ''."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup")) as fh:
            paths = [line.split(":", 2)[2] for line in fh.read().splitlines() if ":" in line]
    except OSError:
        return ""
    for path in paths:
        units = [part for part in path.split("/") if part.endswith(".service")]
        if units:
            return units[-1]
    return ""


def holders(ports, proc="/proc"):
    """port -> the units whose processes listen on it (any address), for each of ports."""
    out = {}
    for port in ports:
        socks = [inode for _addr, inode in listeners(port, proc)]
        owners = socket_owners(socks, proc) if socks else {}
        out[port] = sorted({unit_of(pid, proc) for pid in owners} - {""})
    return out

"""gpufleet_ready's proof that the unit itself answered, and gpufleet_port_holders' answer
of which units hold a port (gpufleet/module_utils/sockets.py): the sockets listening where
a URL points belong to the unit's processes (or to their children, as a container's do to
conmon), read from /proc as the modules read them on a host.

Runs under every host Python (scripts/host-pythons).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys

import pytest

from gpufleet.module_utils import sockets as ready


@pytest.fixture
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_listeners_and_owner_are_read_from_proc(server):
    port = server.getsockname()[1]
    found = ready.listeners(port)
    assert [str(addr) for addr, _ in found] == ["127.0.0.1"]
    owners = ready.socket_owners([inode for _, inode in found])
    assert list(owners) == [os.getpid()]


def test_the_units_own_socket_passes(server, monkeypatch):
    monkeypatch.setattr(ready, "unit_pids", lambda unit: {os.getpid()})
    url = f"http://127.0.0.1:{server.getsockname()[1]}/health"
    assert ready.strangers("gpufleet-x.service", url) == []


def test_another_process_on_the_port_is_named(server, monkeypatch):
    monkeypatch.setattr(ready, "unit_pids", lambda unit: {-1})
    url = f"http://127.0.0.1:{server.getsockname()[1]}/health"
    (who,) = ready.strangers("gpufleet-x.service", url)
    assert who.startswith(f"pid {os.getpid()} (")


def test_a_wildcard_listener_counts_for_every_address(monkeypatch):
    """A process on 0.0.0.0:PORT takes the connections meant for 127.0.0.1:PORT too."""
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen()
    try:
        monkeypatch.setattr(ready, "unit_pids", lambda unit: {-1})
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        assert len(ready.strangers("gpufleet-x.service", url)) == 1
    finally:
        sock.close()


def test_a_child_of_the_unit_owns_it_too(monkeypatch):
    """A container's process is conmon's child, conmon the unit's: owned."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import socket,sys,time; s=socket.socket(); "
         "s.bind(('127.0.0.1',0)); s.listen(); print(s.getsockname()[1], flush=True); "
         "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        url = f"http://127.0.0.1:{port}/"
        monkeypatch.setattr(ready, "unit_pids", lambda unit: {os.getpid()})
        assert ready.strangers("gpufleet-x.service", url) == []
        monkeypatch.setattr(ready, "unit_pids", lambda unit: {-1})
        assert f"pid {child.pid}" in ready.strangers("gpufleet-x.service", url)[0]
    finally:
        child.kill()
        child.wait()


def test_nothing_listening_is_said():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    (gap,) = ready.strangers("gpufleet-x.service", f"http://127.0.0.1:{port}/")
    assert gap == f"no socket listens on 127.0.0.1:{port} on this host"


def test_ipv6_words_are_read_in_host_order():
    # /proc/net/tcp6 of ::ffff:127.0.0.1 and of :: on a little- or big-endian host
    words = socket.inet_pton(socket.AF_INET6, "::ffff:127.0.0.1")
    hexaddr = "".join(f"{struct.unpack('=I', words[i:i + 4])[0]:08X}" for i in range(0, 16, 4))
    assert str(ready._address(hexaddr)) == "127.0.0.1"
    assert ready._address("0" * 32).is_unspecified


def test_holders_name_the_unit_of_each_listener(server, monkeypatch, tmp_path):
    """Which unit a listener runs in comes from its cgroup path (here: this process's)."""
    port = server.getsockname()[1]
    with open(f"/proc/{os.getpid()}/cgroup") as fh:
        path = fh.read().splitlines()[-1].split(":", 2)[2]
    unit = next((p for p in reversed(path.split("/")) if p.endswith(".service")), "")
    assert ready.holders([port]) == {port: [unit] if unit else []}
    fake = tmp_path / "proc" / "42"
    fake.mkdir(parents=True)
    (fake / "cgroup").write_text("0::/system.slice/gpufleet-gateway.service\n")
    assert ready.unit_of(42, str(tmp_path / "proc")) == "gpufleet-gateway.service"
    (fake / "cgroup").write_text("0::/user.slice/session-1.scope\n")
    assert ready.unit_of(42, str(tmp_path / "proc")) == ""

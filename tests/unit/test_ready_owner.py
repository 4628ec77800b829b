"""gpufleet_ready's proof that the unit itself answered: the sockets listening where its
URL points belong to the unit's processes (or to their children, as a container's do to
conmon), read from /proc as the module reads them on a host.

Runs under every host Python (scripts/host-pythons): the module is loaded from its file,
with a stand-in for Ansible's module base where the interpreter has no Ansible.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "gpufleet" / "ansible_plugins" / "modules" / "gpufleet_ready.py"


def _load():
    try:
        import ansible.module_utils.basic  # noqa: F401
    except ImportError:  # a host Python's venv: only what the checks read is needed
        for name in ("ansible", "ansible.module_utils", "ansible.module_utils.basic"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["ansible.module_utils.basic"].AnsibleModule = object
    spec = importlib.util.spec_from_file_location("gpufleet_ready", MODULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ready = _load()


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
    assert list(owners) == [__import__("os").getpid()]


def test_the_units_own_socket_passes(server, monkeypatch):
    import os
    monkeypatch.setattr(ready, "unit_pids", lambda unit: {os.getpid()})
    url = f"http://127.0.0.1:{server.getsockname()[1]}/health"
    assert ready.strangers("gpufleet-x.service", url) == []


def test_another_process_on_the_port_is_named(server, monkeypatch):
    monkeypatch.setattr(ready, "unit_pids", lambda unit: {-1})
    url = f"http://127.0.0.1:{server.getsockname()[1]}/health"
    (who,) = ready.strangers("gpufleet-x.service", url)
    assert who.startswith(f"pid {__import__('os').getpid()} (")


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
    import os
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
    import struct
    hexaddr = "".join(f"{struct.unpack('=I', words[i:i + 4])[0]:08X}" for i in range(0, 16, 4))
    assert str(ready._address(hexaddr)) == "127.0.0.1"
    assert ready._address("0" * 32).is_unspecified

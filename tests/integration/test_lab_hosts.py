"""The lab's hosts and network: real systemd hosts over real SSH, sealed off the machine.

Runs as root; the session fixture `lab` (conftest.py) brings two hosts up.
The last test takes the lab down and checks that nothing is left behind.
"""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import net, services

pytestmark = pytest.mark.lab
REPO = Path(__file__).resolve().parents[2]


def ssh(address: str, command: str, user: str = "root", check: bool = True):
    """Plain OpenSSH with the lab key, as any operator would use it."""
    cmd = [
        "ssh", "-i", str(lab_hosts.SSH_KEY), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
        "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
        "-o", "LogLevel=ERROR", f"{user}@{address}", command,
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check:
        assert res.returncode == 0, f"{command!r} on {address}: {res.stdout}{res.stderr}"
    return res


def probe_wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel, so the test needs nothing from PyPI."""
    files = {
        "gfl_lab_probe/__init__.py": b"VALUE = 42\n",
        "gfl_lab_probe-1.0.dist-info/METADATA": (
            b"Metadata-Version: 2.1\nName: gfl-lab-probe\nVersion: 1.0\n"
        ),
        "gfl_lab_probe-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: gpufleet-test\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("gfl_lab_probe-1.0.dist-info/RECORD,,")
    files["gfl_lab_probe-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / "gfl_lab_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_plan_assigns_profiles_in_order_and_repeats_the_last():
    plan = lab_hosts.plan(3, ["b200x8", "gb200x4"], ["ib-down"])
    assert [h["profile"] for h in plan] == ["b200x8", "gb200x4", "gb200x4"]
    assert [h["address"] for h in plan] == ["10.213.77.11", "10.213.77.12", "10.213.77.13"]
    assert all(h["faults"] == ["ib-down"] for h in plan)
    assert {h["profile"] for h in lab_hosts.plan(2, None, None)} == {"h200x8"}


def test_hosts_answer_over_ssh_as_root_and_the_login_user(lab):
    for host in lab:
        assert ssh(host["address"], "hostname").stdout.strip() == host["name"]
        out = ssh(host["address"], "sudo -n id -u", user=lab_hosts.LOGIN_USER).stdout.strip()
        assert out == "0"


def test_simulated_hardware_files_are_in_the_host(lab):
    hwsim = pytest.importorskip("gpufleet_lab.hwsim")
    files = hwsim.render("h200x8", [], "lab1")
    assert files, "hwsim.render returned nothing"
    out = ssh(lab[0]["address"], "stat -c '%n %a' " + " ".join(sorted(files))).stdout
    got = dict(line.rsplit(" ", 1) for line in out.splitlines())
    assert got == {path: f"{mode:o}" for path, (_, mode) in files.items()}
    # What a file cannot carry, the boot unit provides: device nodes and /proc/driver.
    devices = [ln.split() for ln in files["/etc/gpufleet-lab/devices"][0].decode().splitlines()]
    paths = [d[0] for d in devices if d and not d[0].startswith("#")]
    ssh(lab[0]["address"], " && ".join(f"test -c {p}" for p in paths))
    version = ssh(lab[0]["address"], "cat /proc/driver/nvidia/version").stdout.encode()
    assert version == files["/etc/gpufleet-lab/proc/driver/nvidia/version"][0]


def test_documented_ssh_command_works(lab):
    res = subprocess.run(
        ["ssh", "-F", str(lab_hosts.SSH_CONFIG), "-o", "BatchMode=yes", "lab1", "hostname"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "lab1"
    assert lab_hosts.SSH_KEY.stat().st_mode & 0o777 == 0o600


def test_systemd_is_pid1_and_running(lab):
    for host in lab:
        assert ssh(host["address"], "cat /proc/1/comm").stdout.strip() == "systemd"
        res = ssh(host["address"], "systemctl is-system-running", check=False)
        assert res.stdout.strip() in ("running", "degraded"), res.stdout
        assert ssh(host["address"], "systemctl is-active ssh").stdout.strip() == "active"


def cgroups_of(pid: int) -> dict[str, str]:
    """``/proc/PID/cgroup`` as hierarchy (controllers, '' for v2) -> path."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {ctrls: path for _, ctrls, path in (ln.split(":", 2) for ln in lines)}


def test_each_host_lives_in_a_cgroup_of_its_own(lab):
    """In every hierarchy, a host's systemd and its nspawn sit below the host's own cgroup,
    and no two hosts share one: systemd in one host can never see another's processes."""
    seen: dict[str, set[str]] = {}
    for host in lab:
        init = int(Path(f"/proc/{host['pid']}/task/{host['pid']}/children").read_text().split()[0])
        assert init in lab_hosts.container_inits()
        for pid in (host["pid"], init):
            for ctrls, path in cgroups_of(pid).items():
                assert f"/{lab_hosts.CGROUP_NAME}/{host['name']}/" in path + "/", (
                    f"{host['name']}: pid {pid} is in {ctrls or 'unified'}:{path}")  # fmt: skip
        for ctrls, path in cgroups_of(init).items():
            assert path not in seen.setdefault(ctrls, set()), f"{ctrls or 'unified'}:{path} shared"
            seen[ctrls].add(path)


def test_stopping_a_unit_on_one_host_leaves_the_same_unit_on_another_running(lab):
    """Two hosts run a unit of the same name whose main process has a child. Stopping it on
    one host ends both its processes there and nothing on the other host. (With one shared
    cgroup tree, the stopping systemd fails to kill the unit's cgroup, since it cannot see
    the other host's processes in it, and the child outlives the stop.)"""
    a, b = (h["address"] for h in lab[:2])
    unit = "gpufleet-probe.service"
    procs = "pgrep -fx 'sleep 424[23]'"
    try:
        for addr in (b, a):  # b first: its processes come first in a shared cgroup
            ssh(addr, f"systemd-run --unit={unit} sh -c 'sleep 4242 & exec sleep 4243'")
        running_b = ssh(b, procs).stdout.split()
        assert len(running_b) == 2
        since = ssh(a, "date +%s").stdout.strip()
        ssh(a, f"systemctl stop {unit}")
        time.sleep(1)
        left = ssh(a, f"{procs} -a", check=False).stdout
        log = ssh(a, f"journalctl -q -u {unit} --since @{since} --no-pager").stdout
        assert not left, f"{unit} stopped on {a} but these still run there:\n{left}{log}"
        assert "Failed to kill control group" not in log, log
        assert ssh(b, f"systemctl is-active {unit}", check=False).stdout.strip() == "active"
        assert ssh(b, procs).stdout.split() == running_b
    finally:
        for addr in (a, b):
            ssh(addr, f"systemctl stop {unit}; pkill -fx 'sleep 424[23]'", check=False)


def test_hosts_reach_nothing_off_the_machine(lab):
    gateway = subprocess.run(["ip", "route", "show", "default"], capture_output=True, text=True)
    outside = ["1.1.1.1", "8.8.8.8"] + gateway.stdout.split()[2:3]
    for host in lab:
        assert "default" not in ssh(host["address"], "ip route").stdout
        for address in outside:
            res = ssh(host["address"], f"ip route get {address}", check=False)
            assert res.returncode != 0, f"{host['name']} has a route to {address}: {res.stdout}"
        res = ssh(host["address"], "curl -sS -m 3 --noproxy '*' http://1.1.1.1/", check=False)
        assert res.returncode != 0
    # Root namespace: lab addresses are never forwarded; the lab namespace does not forward.
    rules = subprocess.run(["nft", "list", "table", "inet", net.NFT_TABLE], capture_output=True,
                           text=True).stdout  # fmt: skip
    assert f"ip saddr {net.SUBNET} drop" in rules
    fwd = subprocess.run(["ip", "netns", "exec", net.LAB_NS, "sysctl", "-n",
                          "net.ipv4.ip_forward"], capture_output=True, text=True)  # fmt: skip
    assert fwd.stdout.strip() == "0"


def test_services_listen_on_the_lab_address_only(lab):
    for port in services.PORTS.values():
        out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                             text=True).stdout  # fmt: skip
        local = [line.split()[3] for line in out.splitlines()]
        assert local == [f"{services.controller_address()}:{port}"], out


def test_hosts_use_the_controller_wheel_source_and_apt_proxy(lab):
    wheel = probe_wheel(services.WHEEL_DIR)
    try:
        addr = lab[0]["address"]
        ssh(addr, "rm -rf /tmp/v && python3 -m venv /tmp/v")
        ssh(addr, "/tmp/v/bin/pip install -q --no-cache-dir gfl-lab-probe")  # /etc/pip.conf
        ssh(addr, "/tmp/v/bin/python -c 'import gfl_lab_probe as p; assert p.VALUE == 42'")
        links = ssh(addr, f"curl -fsS {services.wheel_links_url()}").stdout
        assert wheel.name in links
    finally:
        wheel.unlink()
    # the registry answers the hosts anonymously (the image runtime's mirror)
    v2 = ssh(addr, f"curl -sS -o /dev/null -w '%{{http_code}}' {services.registry_url()}/v2/")
    assert v2.stdout.strip() == "200"
    proxy = ssh(addr, "eval $(apt-config shell P Acquire::http::Proxy) && echo $P").stdout.strip()
    assert proxy == services.apt_proxy_url()
    res = ssh(addr, f"curl -fsS -m 60 -x {proxy} -o /dev/null -w '%{{http_code}}' "
                    "http://deb.debian.org/debian/dists/bookworm/Release.gpg")  # fmt: skip
    assert res.stdout.strip() == "200"


def test_inventory_describes_the_hosts_for_ansible(lab):
    inv = yaml.safe_load(lab_hosts.INVENTORY.read_text())
    hosts = inv["all"]["children"]["lab"]["hosts"]
    assert sorted(hosts) == ["lab1", "lab2"]
    assert hosts["lab1"]["ansible_host"] == "10.213.77.11"
    assert hosts["lab1"]["lab_profile"] == "h200x8" and hosts["lab1"]["lab_faults"] == []
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}
    res = subprocess.run(
        [str(REPO / ".venv/bin/ansible"), "-i", str(REPO / "inventories/lab"), "lab",
         "-m", "ansible.builtin.ping", "-o"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SUCCESS") == 2


def test_up_is_idempotent(lab):
    before = (sorted(lab_hosts.nspawn_pids()), sorted(lab_hosts.container_inits()))
    lab_hosts.up(hosts=2)
    after = (sorted(lab_hosts.nspawn_pids()), sorted(lab_hosts.container_inits()))
    assert before == after and len(after[0]) == 2


def _playbook_run(tmp_path, inventory: str) -> subprocess.Popen:
    """A stand-in for an `ansible-playbook -i INVENTORY` run whose parent went away."""
    prog = tmp_path / "bin" / "ansible-playbook"
    prog.parent.mkdir(exist_ok=True)
    prog.write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "checkout").mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, str(prog), "-i", inventory, "site.yml"],
                            cwd=tmp_path / "checkout", start_new_session=True)


def test_up_cleans_up_after_a_killed_lab(lab, tmp_path):
    # a deploy against the lab from a killed run (any checkout's lab inventory), and one
    # against another inventory, which is none of the lab's business
    orphan = _playbook_run(tmp_path, "inventories/lab")
    other = _playbook_run(tmp_path, "inventories/site-a")
    killed = lab_hosts.nspawn_pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    # What a killed session leaves: namespaces, mounts, links, and here even the
    # container inits, which outlive their nspawn.
    assert lab_hosts.lab_mounts() and net.lab_netns() and lab_hosts.container_inits()
    assert lab_hosts.lab_cgroups()
    stale_inits = set(lab_hosts.container_inits())
    up = lab_hosts.up(hosts=2)
    assert not stale_inits & set(lab_hosts.container_inits())
    assert all(lab_hosts.in_host_cgroups(h["pid"], h["name"]) for h in up)
    assert len(lab_hosts.nspawn_pids()) == 2 and not set(killed) & set(lab_hosts.nspawn_pids())
    for host in up:
        assert ssh(host["address"], "systemctl is-system-running", check=False).stdout.strip() in (
            "running", "degraded")  # fmt: skip
    try:
        assert orphan.wait(timeout=10) is not None
        assert other.poll() is None, "a run against another inventory was ended"
    finally:
        other.kill()
        orphan.kill()


def test_down_leaves_nothing_but_the_blackhole_route(lab):
    lab_hosts.down()
    assert lab_hosts.nspawn_pids() == []
    assert lab_hosts.container_inits() == []
    assert lab_hosts.lab_mounts() == []
    assert lab_hosts.lab_cgroups() == []
    assert net.lab_netns() == []
    assert net.lab_links() == []
    assert net.lab_routes() == []
    assert net.blackhole_present()
    assert not any(services.running().values())
    assert not lab_hosts.INVENTORY.exists()
    res = subprocess.run(["ip", "route", "get", "10.213.77.11"], capture_output=True, text=True)
    assert res.returncode != 0 or "blackhole" in res.stdout
    # Booting 4 hosts from the cached root: well under a minute.
    start = time.monotonic()
    lab_hosts.up(hosts=4)
    assert time.monotonic() - start < 45
    lab_hosts.down()

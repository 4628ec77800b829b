"""Lab hosts: systemd-nspawn containers booted with systemd, one netns each.

All hosts boot from one cached debootstrap root (``ROOT_CACHE``) with a
per-host overlayfs (``STATE_DIR/<host>/{upper,work,root}``) and its containers' storage
(``STATE_DIR/<host>/containers``, bound at /var/lib/containers).  The controller
has no systemd, so each ``systemd-nspawn --boot`` runs as our own background
process (setsid), its PID in ``STATE_DIR/<host>/nspawn.pid`` and its console
in ``STATE_DIR/<host>/console.log``; it first joins the host's own cgroup
(``gpufleet-lab/<host>`` in every hierarchy, see "cgroups" below).

Entry points: ``up()``, ``down()``, ``status()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from gpufleet_lab import net, services, wheels
from gpufleet_lab.net import LabError

SUITE = "bookworm"
PACKAGES = [
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "sudo",
    "python3",
    "python3-venv",
    "python3-apt",
    "iproute2",
    "ca-certificates",
    "curl",
    "procps",
    "kmod",
]
# Run in the fresh root (chroot) once; part of the cache key.
ROOT_SETUP = """set -e
useradd -m -s /bin/bash -G sudo labadmin
echo 'labadmin ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/labadmin
chmod 0440 /etc/sudoers.d/labadmin
rm -f /etc/ssh/ssh_host_*
systemctl enable ssh.service
systemctl mask systemd-firstboot.service apt-daily.timer apt-daily-upgrade.timer \
    e2scrub_all.timer fstrim.timer getty@tty1.service
apt-get clean
rm -rf /var/lib/apt/lists/*
: > /etc/machine-id
"""
SOURCES_LIST = """deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
"""
# What hwsim's files need at boot (see its docstring): device nodes, /proc/driver.
HW_UNIT = "gpufleet-lab-hw.service"
HW_SETUP = """#!/bin/sh
# gpufleet lab only: device nodes and /proc files of the simulated hardware.
set -e
L=/etc/gpufleet-lab
if [ -f $L/devices ]; then
    grep -v '^#' $L/devices | while read -r path major minor; do
        [ -n "$path" ] || continue
        mkdir -p -m 0755 "$(dirname "$path")"
        [ -c "$path" ] || mknod -m 0666 "$path" c "$major" "$minor"
    done
fi
if [ -d $L/proc/driver ] && [ -d /proc/driver ] && ! findmnt -rn /proc/driver >/dev/null; then
    mount --bind -o ro $L/proc/driver /proc/driver
fi
if [ -f $L/modules ] && [ -f /proc/modules ] && ! findmnt -rn /proc/modules >/dev/null; then
    mount --bind $L/modules /proc/modules
fi
"""
HW_BOOT_FILES = {
    "/usr/local/lib/gpufleet-lab/hw-setup": (HW_SETUP.encode(), 0o755),
    f"/etc/systemd/system/{HW_UNIT}": (
        b"""[Unit]
Description=gpufleet lab: simulated hardware device nodes and /proc files
DefaultDependencies=no
After=local-fs.target
Before=sysinit.target
ConditionPathExists=/etc/gpufleet-lab

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/lib/gpufleet-lab/hw-setup

[Install]
WantedBy=sysinit.target
""",
        0o644,
    ),
}
DEFAULT_PROFILE = "h200x8"
# The sudo-enabled login user of every lab host. Not `gpufleet`: that is the service
# user the deploy creates for the engines, and a lab must not lend it a login shell.
LOGIN_USER = "labadmin"
CACHE_DIR = Path("/var/cache/gpufleet-lab")
STATE_DIR = Path("/var/lib/gpufleet-lab")
SSH_DIR = STATE_DIR / "ssh"
SSH_KEY = SSH_DIR / "id_ed25519"
SSH_CONFIG = SSH_DIR / "config"
STATE_FILE = STATE_DIR / "lab.json"
# The checkpoint cache every lab host mounts at the same path: really shared, as the
# NFS/Lustre mount of a real site. The disk-small fault swaps in a tiny tmpfs.
SHARED_CACHE = STATE_DIR / "shared-cache"
SMALL_CACHE = STATE_DIR / "shared-cache-small"
SMALL_CACHE_SIZE = "64m"
# The cache filesystem is as large as a site's (a sparse ext4 image: a few MB on disk),
# so the disk-space checks see a real filesystem with real room for 1.5 TB checkpoints.
CACHE_IMAGE = CACHE_DIR / "shared-cache.img"
CACHE_IMAGE_SIZE = "2T"
HOST_CACHE_PATH = "/var/cache/gpufleet/hf"
CONTAINERS_PATH = "/var/lib/containers"
APT_LISTS = "var/lib/apt/lists"
REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "inventories" / "lab" / "hosts.yml"
BOOT_TIMEOUT = 90
REQUIRED = {  # binary -> Debian package that ships it
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "ip": "iproute2",
    "nft": "nftables",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "apt-cacher-ng": "apt-cacher-ng",
    "mkfs.ext4": "e2fsprogs",
    "docker-registry": "docker-registry",
}


def log(msg: str) -> None:
    print(f"lab: {msg}", flush=True)


# ---------------------------------------------------------------- checks


# The lab's hosts share the controller's kernel, and with it the per-user inotify limits a
# real host has to itself: every lab host's systemd, journald and logind hold inotify
# instances as root, so past about eight hosts the kernel's default of 128 instances runs
# out and a program that watches files on a host (Dynamo's file discovery) fails with "Too
# many open files". The lab raises the limits to what a host each would give (never lowers).
INOTIFY = {"fs/inotify/max_user_instances": 8192, "fs/inotify/max_user_watches": 524288}


def raise_inotify_limits(proc_sys: Path = Path("/proc/sys")) -> None:
    for name, floor in INOTIFY.items():
        path = proc_sys / name
        if int(path.read_text()) < floor:
            path.write_text(f"{floor}\n")


def check_prereqs() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, mounts): run it as root")
    missing = sorted({pkg for exe, pkg in REQUIRED.items() if shutil.which(exe) is None})
    if missing:
        raise LabError(f"missing programs; install them: apt-get install -y {' '.join(missing)}")


# ---------------------------------------------------------------- cached root


def root_key() -> str:
    text = "\n".join([SUITE, *sorted(PACKAGES), ROOT_SETUP, SOURCES_LIST])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def root_dir(cache: Path = CACHE_DIR) -> Path:
    return cache / f"root-{root_key()}"


def ensure_root(cache: Path = CACHE_DIR) -> Path:
    """Build the cached debootstrap root in ``cache`` once per package list (about a
    minute); an empty ``cache`` means a root built from nothing, as on a fresh machine."""
    root = root_dir(cache)
    if (root / "etc" / "os-release").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"building cached root {root} (once; a few minutes)")
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        SUITE,
        str(tmp),
        services.debian_mirror(),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise LabError(
            f"debootstrap failed (is the Debian mirror reachable?):\n"
            f"{res.stdout[-2000:]}{res.stderr[-2000:]}"
        )
    (tmp / "etc/apt/sources.list").write_text(SOURCES_LIST)
    res = subprocess.run(
        ["chroot", str(tmp), "/bin/sh", "-c", ROOT_SETUP], capture_output=True, text=True
    )
    if res.returncode != 0:
        raise LabError(f"preparing the cached root failed:\n{res.stderr[-2000:]}")
    tmp.rename(root)
    for old in cache.glob("root-*"):
        if old != root:
            shutil.rmtree(old, ignore_errors=True)
    return root


# ---------------------------------------------------------------- ssh


def ensure_ssh_key() -> str:
    SSH_DIR.mkdir(parents=True, exist_ok=True)
    SSH_DIR.chmod(0o700)
    if not SSH_KEY.exists():
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpufleet-lab"]
        subprocess.run([*keygen, "-f", str(SSH_KEY)], check=True)
    SSH_KEY.chmod(0o600)
    return SSH_KEY.with_suffix(".pub").read_text()


def write_ssh_config(hosts: list[dict]) -> None:
    blocks = [f"Host {h['name']}\n    HostName {h['address']}\n" for h in hosts]
    common = (
        f"Host {' '.join(h['name'] for h in hosts) or 'lab*'}\n"
        f"    User root\n    IdentityFile {SSH_KEY}\n    IdentitiesOnly yes\n"
        "    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n"
        "    LogLevel ERROR\n    ConnectTimeout 5\n"
    )
    SSH_CONFIG.write_text("".join(blocks) + common)
    SSH_CONFIG.chmod(0o600)


def ssh_cmd(host: str, *command: str, user: str = "root", batch: bool = True) -> list[str]:
    """The ssh command line for running ``command`` on a lab host."""
    opts = ["-o", "BatchMode=yes"] if batch else []
    return ["ssh", "-F", str(SSH_CONFIG), "-l", user, *opts, host, *command]


JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"


def kernel_message(host: str, message: str) -> None:
    """Put a kernel message (an Xid) into a lab host's journal as the kernel's own lands
    there: _TRANSPORT=kernel, this boot, this machine. A container gets no kernel messages,
    so the controller writes a journal file from journald's export format
    (systemd-journal-remote) into the host's journal directory, where journalctl -k reads
    it and journalctl -k -f sees it appear (in every service too: BOOT_ID_DROPINS)."""
    if not os.path.exists(JOURNAL_REMOTE):
        raise LabError(f"{JOURNAL_REMOTE} is missing: apt-get install systemd-journal-remote "
                       "(scripts/setup does)")
    facts = subprocess.run(ssh_cmd(host, "cat /proc/sys/kernel/random/boot_id /etc/machine-id "
                                   "/proc/uptime"), capture_output=True, text=True, timeout=30)
    if facts.returncode != 0:
        raise LabError(f"{host}: cannot read its boot id: {facts.stderr.strip()}")
    boot, machine, uptime = facts.stdout.split()[:3]
    fields = {"__REALTIME_TIMESTAMP": time.time_ns() // 1000,
              "__MONOTONIC_TIMESTAMP": int(float(uptime) * 1e6),
              "_BOOT_ID": boot.replace("-", ""), "_MACHINE_ID": machine, "_HOSTNAME": host,
              "_TRANSPORT": "kernel", "SYSLOG_FACILITY": 0, "PRIORITY": 4,
              "SYSLOG_IDENTIFIER": "kernel", "MESSAGE": message}
    export = "".join(f"{k}={v}\n" for k, v in fields.items()) + "\n"
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "entry.export", Path(tmp) / "kernel.journal"
        source.write_text(export)
        subprocess.run([JOURNAL_REMOTE, f"--output={out}", str(source)], check=True,
                       capture_output=True, timeout=30)
        name = f"/var/log/journal/{machine}/lab-kernel-{time.time_ns()}.journal"
        # written beside, then renamed: journalctl never opens half a file
        put = subprocess.run(ssh_cmd(host, f"cat > {name}.part && mv {name}.part {name}"),
                             input=out.read_bytes(), capture_output=True, timeout=30)
    if put.returncode != 0:
        raise LabError(f"{host}: cannot write {name}: {put.stderr.decode().strip()}")


def clear_kernel_messages(host: str) -> None:
    """Remove the kernel messages kernel_message put into a host's journal, as a reboot
    leaves a fresh kernel log: a later deploy whose checker starts without a journal cursor
    (after a teardown) reads this boot's kernel log from its start and would find them."""
    # The health checker's journal cursor may name an entry of a removed file: it reads on
    # from the first entry after that entry's place (healthcheck.journal_from).
    done = subprocess.run(ssh_cmd(host, "rm -f /var/log/journal/*/lab-kernel-*.journal"),
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LabError(f"{host}: cannot remove its lab kernel messages: {done.stderr.strip()}")


# ---------------------------------------------------------------- per-host files


def _in_root(lower: Path, rel: Path) -> Path:
    """``rel`` with directory symlinks of the lower root resolved (merged /usr: lib -> usr/lib)."""
    out = Path()
    for i, part in enumerate(rel.parts):
        if (lower / out / part).is_symlink():
            target = os.readlink(lower / out / part)
            joined = os.path.normpath(os.path.join("/", out, target)).lstrip("/")
            return _in_root(lower, Path(joined, *rel.parts[i + 1 :]))
        out /= part
    return out


def _mkdirs(upper: Path, lower: Path, rel: Path) -> None:
    """Create ``rel`` in an overlay upper dir; new dirs copy the lower dir's owner/mode."""
    parent = Path()
    for part in _in_root(lower, rel).parts:
        parent /= part
        target = upper / parent
        if not target.exists():
            target.mkdir()
            src = lower / parent
            if src.is_dir():
                st = src.stat()
                os.chown(target, st.st_uid, st.st_gid)
                target.chmod(st.st_mode & 0o7777)


def _put(
    upper: Path, lower: Path, path: str, content: bytes, mode: int, uid: int = 0, gid: int = 0
) -> None:
    """Write ``path`` (absolute in the host) into an overlay upper dir."""
    rel = _in_root(lower, Path(path.lstrip("/")).parent) / Path(path).name
    _mkdirs(upper, lower, rel.parent)
    dest = upper / rel
    dest.write_bytes(content)
    os.chown(dest, uid, gid)
    dest.chmod(mode)


def _user_ids(root: Path, user: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        f = line.split(":")
        if f[0] == user:
            return int(f[2]), int(f[3])
    raise LabError(f"user {user} missing in {root}; delete {CACHE_DIR} to rebuild the root")


def render_hw(profile: str, faults: list[str], hostname: str) -> dict:
    """Simulated hardware files from gpufleet_lab.hwsim, or {} while it does not exist."""
    try:
        hwsim = importlib.import_module("gpufleet_lab.hwsim")
    except ModuleNotFoundError as exc:
        if exc.name != "gpufleet_lab.hwsim":
            raise
        return {}
    try:
        return hwsim.render(profile, faults, hostname)
    except ValueError as exc:
        raise LabError(f"{hostname}: {exc}") from None


# systemd-nspawn shows the container its own boot id (over /proc/sys/kernel/random/boot_id);
# a service that mounts its own /proc (ProtectProc=, ProtectKernelTunables=,
# ProtectControlGroups= imply it; the health units set them) reads the kernel's instead, and
# its journalctl -k keeps other entries than an ssh session's (binding the file back in
# fails under their sandbox). A real host has one boot id: these vendor drop-ins (outside
# /etc, so nothing gpufleet manages or records) keep the container's /proc for them.
BOOT_ID_DROPINS = {
    f"/usr/lib/systemd/system/{unit}.d/gpufleet-lab-boot-id.conf": (
        b"# gpufleet lab: the container's /proc, so the container's boot id\n"
        b"[Service]\nProtectProc=default\nProtectKernelTunables=no\n"
        b"ProtectControlGroups=no\n", 0o644)
    for unit in ("gpufleet-health.service", "gpufleet-health-watch.service")
}


def prepare_host(host: dict, all_hosts: list[dict], root: Path, pubkey: str, hw: dict) -> Path:
    """Fresh upper dir for ``host`` with its identity, keys, lab config and simulated
    hardware files ``hw`` (from render_hw); returns the host's state dir."""
    hdir = STATE_DIR / host["name"]
    shutil.rmtree(hdir, ignore_errors=True)
    upper = hdir / "upper"
    for d in ("upper", "work", "root", "containers"):
        (hdir / d).mkdir(parents=True)
    (hdir / "containers").chmod(0o700)
    ctrl = services.controller_address()
    uid, gid = _user_ids(root, LOGIN_USER)
    hosts_lines = [f"127.0.0.1 localhost\n{ctrl} controller gpufleet-controller\n"]
    hosts_lines += [f"{h['address']} {h['name']}\n" for h in all_hosts]
    files: dict[str, tuple[bytes, int]] = {
        "/etc/hostname": (f"{host['name']}\n".encode(), 0o644),
        "/etc/hosts": ("".join(hosts_lines).encode(), 0o644),
        "/etc/machine-id": (f"{uuid.uuid4().hex}\n".encode(), 0o444),
        "/root/.ssh/authorized_keys": (pubkey.encode(), 0o600),
        "/etc/apt/apt.conf.d/01gpufleet-proxy": (
            f'Acquire::http::Proxy "http://{ctrl}:{services.APT_PROXY_PORT}";\n'
            'Acquire::https::Proxy "DIRECT";\n'
            # a download the proxy stalls (seen with 8+ hosts at once) fails after a
            # minute and apt tries it again, instead of hanging the deploy
            'Acquire::http::Timeout "60";\nAcquire::Retries "3";\n'.encode(),
            0o644,
        ),
        "/etc/pip.conf": (
            f"[global]\nindex-url = {services.wheel_index_url()}\n"
            f"trusted-host = {ctrl}\n".encode(),
            0o644,
        ),
    }
    files.update(BOOT_ID_DROPINS)
    if hw:
        files.update(HW_BOOT_FILES)
        files.update(hw)
    # Enabled as `systemctl enable` would: each unit written to /etc/systemd/system (the
    # lab's HW_UNIT, the site's dcgm-exporter from hwsim) linked into <target>.wants for
    # every target of its [Install] WantedBy=. Vendor units (/lib, /usr/lib) stay disabled.
    for path, (content, _) in files.items():
        unit = Path(path)
        if str(unit.parent) != "/etc/systemd/system" or unit.suffix not in (
                ".service", ".socket", ".timer", ".path", ".mount", ".target"):
            continue
        install = content.decode().partition("\n[Install]\n")[2].partition("\n[")[0]
        for line in install.splitlines():
            key, _, targets = line.partition("=")
            if key.strip() != "WantedBy":
                continue
            for target in targets.split():
                wants = upper / f"etc/systemd/system/{target}.wants"
                _mkdirs(upper, root, wants.relative_to(upper))
                (wants / unit.name).symlink_to(path)
    for path, (content, mode) in files.items():
        _put(upper, root, path, content, mode)
    home = f"home/{LOGIN_USER}"
    _put(upper, root, f"/{home}/.ssh/authorized_keys", pubkey.encode(), 0o600, uid, gid)
    os.chown(upper / home / ".ssh", uid, gid)
    (upper / home / ".ssh").chmod(0o700)
    (upper / "root/.ssh").chmod(0o700)
    _mkdirs(upper, root, Path("etc/ssh"))
    subprocess.run(["ssh-keygen", "-A", "-f", str(upper)], check=True, capture_output=True)
    # Like a server fresh from an image that cleaned its apt lists: apt knows no package
    # and the lists directory was modified just now, whenever the cached root was built.
    _mkdirs(upper, root, Path(APT_LISTS))
    return hdir


# ---------------------------------------------------------------- processes and mounts


def nspawn_pids() -> list[int]:
    """PIDs of systemd-nspawn processes that run a lab host (ours, by state dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            args = (p / "cmdline").read_bytes().split(b"\0") if p.name.isdigit() else []
        except OSError:
            continue
        if args[:1] == [b"systemd-nspawn"] and any(str(STATE_DIR).encode() in a for a in args):
            pids.append(int(p.name))
    return pids


def container_inits() -> list[int]:
    """Container inits (PID 1 of a child PID namespace whose root is one of our overlays).

    A killed systemd-nspawn leaves its container's systemd running; these find it."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if not p.name.isdigit():
                continue
            status = (p / "status").read_text()
            nspid = next(ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:"))
            if len(nspid) < 2 or nspid[-1] != "1":
                continue
            mounts = (p / "mountinfo").read_text().splitlines()
        except (OSError, StopIteration):
            continue
        if any(ln.split()[4] == "/" and f"upperdir={STATE_DIR}/" in ln for ln in mounts):
            pids.append(int(p.name))
    return pids


def lab_mounts() -> list[str]:
    """Mount points under STATE_DIR, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(STATE_DIR) or point.startswith(str(STATE_DIR) + "/"):
            points.append(point)
    return sorted(set(points), key=len, reverse=True)


def _kill(pids: list[int], timeout: float = 10.0) -> None:
    """SIGTERM (nspawn asks the container's systemd to power off), then SIGKILL."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(services.pid_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if services.pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(services.pid_alive(p) for p in pids):
        time.sleep(0.1)


def controller_runs() -> list[int]:
    """Controller processes that work on the lab: ansible-playbook runs against the lab's
    inventory and their SSH connections (the lab's key). One whose test run or deploy was
    killed keeps retrying the lab's addresses, and would reach the next lab's hosts.
    `down` ends them (so does `up` when it rebuilds the lab)."""
    mine = {os.getpid(), os.getppid()}
    # any checkout's lab inventory: the lab's hosts are this machine's, whichever wrote it
    ends = ("/" + str(INVENTORY.parent.relative_to(REPO)), "/" + str(INVENTORY.relative_to(REPO)))
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            argv = [a.decode(errors="replace") for a in
                    (entry / "cmdline").read_bytes().split(b"\0") if a]
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        lab_ssh = any(str(SSH_KEY) in a for a in argv) and Path(argv[0]).name == "ssh"
        playbook = any(Path(a).name == "ansible-playbook" for a in argv[:2]) and any(
            os.path.normpath(os.path.join(cwd, a)).endswith(ends) for a in argv)
        if lab_ssh or playbook:
            found.append(int(entry.name))
    return found


def _umount_all() -> None:
    for _ in range(3):
        points = lab_mounts()
        if not points:
            return
        for point in points:
            subprocess.run(["umount", point], capture_output=True)
    for point in lab_mounts():  # still busy: detach so nothing stays visible
        subprocess.run(["umount", "-l", point], capture_output=True)


# ---------------------------------------------------------------- cgroups
# Each host runs in a cgroup of its own, in every mounted hierarchy: nspawn --keep-unit
# gives the container the cgroup it was started in, and the container's systemd builds
# its system.slice/<unit> tree there. Started from a shared cgroup, every host would
# build into one tree, and systemd fails to kill a unit's cgroup that holds processes of
# another host (it cannot see them): a stopped unit's children live on.
CGROUP_NAME = "gpufleet-lab"
# Run as `sh -c JOIN sh <cgroup.procs files> -- <command>`: join the cgroups, then exec.
JOIN_CGROUPS = """while [ "$1" != -- ]; do
    echo $$ > "$1" || { echo "lab: cannot join cgroup ${1%/*}" >&2; exit 1; }
    shift
done
shift
exec "$@"
"""


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """Mounted cgroup hierarchies: key as in /proc/self/cgroup (its controllers, '' for
    v2) -> (mount point, hierarchy path mounted there)."""
    keys = list(_proc_cgroups("self"))
    found: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, (fstype, _source, opts) = line.split(), line.split(" - ", 1)[1].split()[:3]
        if fstype == "cgroup2":
            key = ""
        elif fstype == "cgroup":
            key = next((k for k in keys if k and set(k.split(",")) <= set(opts.split(","))), "-")
        else:
            continue
        if key in keys:
            found.setdefault(key, (fields[4], fields[3]))
    return found


def _proc_cgroups(pid: int | str) -> dict[str, str]:
    """``/proc/PID/cgroup``: hierarchy key (its controllers, '' for v2) -> cgroup path."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {key: path for _, key, path in (ln.split(":", 2) for ln in lines)}


def _cgroup_parents() -> dict[str, Path]:
    """``<this process's cgroup>/gpufleet-lab`` in every mounted hierarchy: where the
    hosts' cgroups go (nested, so limits on our own cgroup still hold for the lab)."""
    own = _proc_cgroups("self")
    parents = {}
    for key, (point, mounted) in _cgroup_mounts().items():
        rel = os.path.relpath(own[key], mounted)
        if not rel.startswith(".."):  # our cgroup is not visible in this mount: skip it
            parents[key] = Path(point, rel, CGROUP_NAME)
    return parents


def in_host_cgroups(pid: int, name: str) -> bool:
    """True if ``pid`` runs below host ``name``'s own cgroup in every hierarchy we use."""
    try:
        paths = _proc_cgroups(pid)
    except OSError:
        return False
    mark = f"/{CGROUP_NAME}/{name}/"
    return all(mark in paths.get(key, "") + "/" for key in _cgroup_parents())


def lab_cgroups() -> list[Path]:
    """Every ``gpufleet-lab`` cgroup in every hierarchy: this lab's and a killed lab's
    (started from another cgroup, their parent may differ from ours)."""
    found = []
    for point, _ in _cgroup_mounts().values():
        for dirpath, dirnames, _ in os.walk(point):
            if Path(dirpath).name == CGROUP_NAME:
                found.append(Path(dirpath))
                dirnames.clear()
    return found


def _cgroup_pids(top: Path) -> list[int]:
    pids = []
    for dirpath, _, _ in os.walk(top):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (Path(dirpath) / "cgroup.procs").read_text().split()]
    return pids


def remove_cgroups(tops: list[Path], timeout: float = 10.0) -> None:
    """Kill whatever still runs in the cgroups ``tops`` and remove them depth first."""
    deadline = time.monotonic() + timeout
    while True:
        for top in tops:
            for pid in _cgroup_pids(top):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for dirpath, _, _ in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        left = [top for top in tops if top.exists()]
        if not left:
            return
        if time.monotonic() > deadline:
            raise LabError(
                f"cgroups still busy after {timeout}s: {', '.join(map(str, left))} (processes "
                f"{_cgroup_pids(left[0])}); end those processes, then run `fab lab.down` again"
            )
        time.sleep(0.2)


def make_host_cgroups(name: str) -> list[Path]:
    """Fresh cgroups for host ``name``, one per hierarchy, as ``<parent>/gpufleet-lab/<name>``;
    what an earlier boot of the host left there is removed first."""
    remove_cgroups([parent / name for parent in lab_cgroups()])
    made = []
    for parent in _cgroup_parents().values():
        for path in (parent, parent / name):
            path.mkdir(exist_ok=True)
            for knob in ("cpuset.cpus", "cpuset.mems"):  # v1 cpuset starts empty: fill it in
                mine, theirs = path / knob, path.parent / knob
                if mine.exists() and theirs.exists() and not mine.read_text().strip():
                    mine.write_text(theirs.read_text())
        made.append(parent / name)
    return made


def cache_source(host: dict) -> Path:
    """The controller directory a host mounts as its checkpoint cache."""
    if "disk-small" not in host["faults"]:
        SHARED_CACHE.mkdir(parents=True, exist_ok=True)
        if not CACHE_IMAGE.exists():
            CACHE_IMAGE.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["truncate", "-s", CACHE_IMAGE_SIZE, str(CACHE_IMAGE)], check=True)
            subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E",
                            "lazy_itable_init=1,lazy_journal_init=1", str(CACHE_IMAGE)],
                           check=True, capture_output=True)
        if str(SHARED_CACHE) not in lab_mounts():
            subprocess.run(["mount", "-o", "loop", str(CACHE_IMAGE), str(SHARED_CACHE)],
                           check=True, capture_output=True)
        return SHARED_CACHE
    SMALL_CACHE.mkdir(parents=True, exist_ok=True)
    if str(SMALL_CACHE) not in lab_mounts():
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_CACHE_SIZE},mode=0755",
                        "tmpfs", str(SMALL_CACHE)], check=True, capture_output=True)
    return SMALL_CACHE


def hardware_of(profile: str) -> str:
    """Catalog hardware name of a lab profile: the longest catalog name the profile starts
    with, followed by the GPU count (h200x8 -> h200, gb200x4 -> gb200, mi355x8 -> mi355x)."""
    from gpufleet import catalog

    names = [n for n in catalog.load().hardware if re.fullmatch(rf"{n}x?\d+", profile)]
    return max(names, key=len) if names else re.sub(r"x\d+$", "", profile)


# Faults of how a host boots, applied by start_host (the others shape its simulated
# hardware): each withholds a capability the host otherwise boots with.
BOOT_FAULTS = {"no-ipc-lock": "CAP_IPC_LOCK"}
# a host administers its own network namespace (nftables, as on a server), and its
# engines' containers may lock memory for RDMA
CAPABILITIES = ("CAP_NET_ADMIN", "CAP_IPC_LOCK")


def start_host(host: dict, hdir: Path, root: Path) -> int:
    merged = hdir / "root"
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={root},upperdir={hdir / 'upper'},workdir={hdir / 'work'}",
            str(merged),
        ],
        check=True,
        capture_output=True,
    )
    cmd = [
        "systemd-nspawn",
        "--boot",
        "--quiet",
        f"--directory={merged}",
        f"--machine={host['name']}",
        f"--hostname={host['name']}",
        "--register=no",
        "--keep-unit",
        f"--network-namespace-path=/run/netns/{net.host_ns(host['name'])}",
        "--capability=" + ",".join(
            c for c in CAPABILITIES
            if c not in {BOOT_FAULTS.get(f) for f in host.get("faults", [])}),
        "--resolv-conf=off",
        "--timezone=off",
        "--link-journal=no",
        "--console=read-only",
        "--kill-signal=SIGRTMIN+3",
        f"--bind={cache_source(host)}:{HOST_CACHE_PATH}",
        # the containers' storage on a disk file system of its own, as a server's
        # /var/lib is: podman stores images as overlay layers there, not as a full copy
        # per container (vfs, all an overlayfs root would allow)
        f"--bind={hdir / 'containers'}:{CONTAINERS_PATH}",
    ]
    joins = [str(cg / "cgroup.procs") for cg in make_host_cgroups(host["name"])]
    with open(hdir / "console.log", "wb") as out:
        proc = subprocess.Popen(
            ["sh", "-c", JOIN_CGROUPS, "sh", *joins, "--", *cmd],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    (hdir / "nspawn.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def host_state(host: dict) -> str:
    """'running', 'degraded', 'starting', 'stopped' or 'unreachable'."""
    pid = host.get("pid")
    if not pid or not services.pid_alive(pid, "systemd-nspawn"):
        return "stopped"
    res = subprocess.run(
        ssh_cmd(host["name"], "systemctl", "is-system-running"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if res.returncode == 255:
        return "unreachable"
    return res.stdout.strip() or "unreachable"


def wait_ready(hosts: list[dict], timeout: float = BOOT_TIMEOUT) -> None:
    pending = {h["name"]: h for h in hosts}
    deadline = time.monotonic() + timeout
    while pending:
        for name, host in list(pending.items()):
            if not services.pid_alive(host["pid"], "systemd-nspawn"):
                tail = (STATE_DIR / name / "console.log").read_text(errors="replace")[-1500:]
                raise LabError(f"{name}: systemd-nspawn exited during boot; console:\n{tail}")
            if host_state(host) in ("running", "degraded"):
                del pending[name]
        if not pending:
            break
        if time.monotonic() > deadline:
            raise LabError(
                f"hosts not ready after {timeout}s: {', '.join(pending)}; see "
                f"{STATE_DIR}/<host>/console.log"
            )
        time.sleep(0.5)


# ---------------------------------------------------------------- state and inventory


def load_state() -> dict:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {"hosts": []}


def save_state(state: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps(state, indent=2) + "\n")


def write_inventory(hosts: list[dict]) -> None:
    lines = [
        "---",
        "# Generated by gpufleet_lab.hosts.up(); do not edit.",
        "all:",
        "  children:",
        "    lab:",
        "      hosts:",
    ]
    host_lines = []
    for h in hosts:
        host_lines += [
            f"        {h['name']}:",
            f"          ansible_host: {h['address']}",
            "          ansible_user: root",
            f"          ansible_ssh_private_key_file: {SSH_KEY}",
            "          ansible_ssh_common_args: >-",
            "            -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
            f"          lab_profile: {h['profile']}",
            f"          lab_faults: {json.dumps(h['faults'])}",
            f"          gpufleet_hardware: {hardware_of(h['profile'])}",
        ]
    lines += host_lines
    # The groups targets use: one-node targets run on lab1 (workers); two-node
    # targets put prefill on lab1 and decode on lab2.
    groups = {"workers": hosts[:1], "prefill": hosts[:1], "decode": hosts[1:2]}
    for group, members in groups.items():
        if members:
            lines += [f"    {group}:", "      hosts:"]
            lines += [f"        {h['name']}: {{}}" for h in members]
    INVENTORY.parent.mkdir(parents=True, exist_ok=True)
    INVENTORY.write_text("\n".join(lines) + "\n")


def plan(hosts: int, profiles: list[str] | None, faults: list[str] | None) -> list[dict]:
    if hosts < 1 or hosts > 50:
        raise LabError(f"--hosts must be between 1 and 50, not {hosts}")
    profiles = [p for p in (profiles or []) if p] or [DEFAULT_PROFILE]
    faults = [f for f in (faults or []) if f]
    return [
        {
            "name": f"lab{i}",
            "address": net.host_address(i),
            "profile": profiles[min(i, len(profiles)) - 1],
            "faults": faults,
        }
        for i in range(1, hosts + 1)
    ]


def _healthy(running: list[dict], wanted: list[dict]) -> bool:
    """True when exactly the wanted hosts run, each alive with its netns, mount and cgroup."""
    key = [(h["name"], h["address"], h["profile"], h["faults"]) for h in wanted]
    if [(h["name"], h["address"], h["profile"], h["faults"]) for h in running] != key:
        return False
    mounts, namespaces = lab_mounts(), net.list_netns()
    return set(nspawn_pids()) == {h.get("pid") for h in running} and all(
        net.host_ns(h["name"]) in namespaces
        and str(STATE_DIR / h["name"] / "root") in mounts
        and in_host_cgroups(h["pid"], h["name"])
        for h in running
    )


# ---------------------------------------------------------------- public API


def up(
    hosts: int = 2, profiles: list[str] | None = None, faults: list[str] | None = None,
    root_cache: Path = CACHE_DIR,
) -> list[dict]:
    """Bring the lab up with ``hosts`` hosts; idempotent; cleans up a killed lab first.
    ``root_cache``: where the hosts' root is cached (built there if missing)."""
    check_prereqs()
    raise_inotify_limits()
    wanted = plan(hosts, profiles, faults)
    hw = {h["name"]: render_hw(h["profile"], h["faults"], h["name"]) for h in wanted}
    state = load_state()
    if _healthy(state["hosts"], wanted) and net.LAB_NS in net.list_netns():
        net.setup_lab_net()
        services.start()
        write_ssh_config(state["hosts"])
        write_inventory(state["hosts"])
        wait_ready(state["hosts"])
        log(f"already up: {', '.join(h['name'] for h in state['hosts'])}")
        return state["hosts"]
    leftovers = [state["hosts"], nspawn_pids(), container_inits(), lab_mounts(),
                 net.lab_netns(), net.lab_links(), lab_cgroups()]  # fmt: skip
    if any(leftovers):
        log("cleaning up the previous lab")
        down()
    root = ensure_root(root_cache)
    pubkey = ensure_ssh_key()
    t0 = time.monotonic()
    net.setup_lab_net()
    services.start()
    try:
        wheels.ensure(log)
    except wheels.WheelError as exc:
        raise LabError(str(exc)) from None
    write_ssh_config(wanted)
    for i, host in enumerate(wanted, start=1):
        net.setup_host_net(host["name"], i)
        hdir = prepare_host(host, wanted, root, pubkey, hw[host["name"]])
        host["pid"] = start_host(host, hdir, root)
        save_state({"hosts": wanted, "root": str(root)})
    wait_ready(wanted)
    write_inventory(wanted)
    log(
        f"{len(wanted)} hosts up in {time.monotonic() - t0:.1f}s; "
        f"ssh -F {SSH_CONFIG} {wanted[0]['name']}"
    )
    return wanted


def reboot(name: str, boot_faults: list[str] | None = None) -> dict:
    """Power a lab host off cleanly and boot it again from its own overlay, as a real
    reboot would: what was installed and enabled on it stays. BOOT_FAULTS (when given):
    the faults of how the host boots (BOOT_FAULTS) it has from now on, as a firmware or
    kernel change would bring; the simulated hardware stays as `up` made it."""
    unknown = sorted(set(boot_faults or []) - set(BOOT_FAULTS))
    if unknown:
        raise LabError(f"{', '.join(unknown)}: not a fault of how a host boots; "
                       f"reboot takes {', '.join(BOOT_FAULTS)} (others: fab lab.up --fault)")
    check_prereqs()
    state = load_state()
    host = next((h for h in state["hosts"] if h["name"] == name), None)
    if host is None:
        raise LabError(f"no lab host {name!r}; hosts: "
                       f"{', '.join(h['name'] for h in state['hosts']) or 'none (lab is down)'}")
    if boot_faults is not None:
        host["faults"] = [f for f in host.get("faults", []) if f not in BOOT_FAULTS] + boot_faults
    _kill([host["pid"]], timeout=60)
    hdir = STATE_DIR / name
    subprocess.run(["umount", str(hdir / "root")], capture_output=True, check=False)
    root = Path(state["root"]) if state.get("root") else ensure_root()
    host["pid"] = start_host(host, hdir, root)
    save_state(state)
    write_inventory(state["hosts"])  # lab_faults
    wait_ready([host])
    log(f"{name} rebooted")
    return host


def down() -> None:
    """Stop every lab host and service; leave only the blackhole route (and nft guard)."""
    check_prereqs()
    _kill(controller_runs(), timeout=5)
    _kill(nspawn_pids())
    for pid in container_inits():  # orphans of a killed nspawn; killing PID 1 ends its ns
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:  # the hosts' cgroups, with anything still in them
        remove_cgroups(lab_cgroups())
        busy = None
    except LabError as exc:
        busy = exc
    services.stop()
    _umount_all()
    net.teardown()
    for hdir in STATE_DIR.glob("lab*"):
        shutil.rmtree(hdir, ignore_errors=True)
    save_state({"hosts": []})
    if INVENTORY.exists():
        INVENTORY.unlink()
    if busy:
        raise busy


def status() -> list[dict]:
    """One dict per lab host: name, address, profile, faults, pid, state."""
    return [{**h, "state": host_state(h)} for h in load_state()["hosts"]]

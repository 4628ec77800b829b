"""Controller services for lab hosts: an apt proxy, a Python wheel source, a Hugging Face
mirror and a container registry.

These are the mechanisms an air-gapped site uses too: hosts get Debian packages
only through the apt proxy (apt-cacher-ng), Python packages only from the
wheel source and images only from the registry (Debian's docker-registry, the image
runtime's mirror), all listening on the controller's lab-side address only.

The controller has no systemd, so both run as background processes started by
``start()`` (PID files under ``SERVICE_DIR``) and ended by ``stop()``.

Serve a directory of wheels:  ``python -m gpufleet_lab.services serve-wheels``.
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import signal
import socket
import subprocess
import sys
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gpufleet_lab import net
from gpufleet_lab.net import LabError

APT_PROXY_PORT = 3142
WHEEL_PORT = 3141
HF_MIRROR_PORT = 3143
REGISTRY_PORT = 5000
REGISTRY_DIR = Path("/var/lib/gpufleet-lab/registry")
WHEEL_DIR = Path("/var/lib/gpufleet-lab/wheels")
SERVICE_DIR = Path("/var/lib/gpufleet-lab/services")
APT_CACHE_DIR = Path("/var/cache/gpufleet-lab/apt-cacher-ng")
LAB = Path(__file__).resolve().parents[1]  # lab/, where gpufleet_lab is importable from
REPO = LAB.parent


def controller_address() -> str:
    """The controller's address on the lab subnet; lab hosts reach it, nothing else."""
    return net.CTRL_ADDR


def wheel_index_url() -> str:
    """PEP 503 simple index for ``pip install --index-url`` (the FlashInfer faults are lab
    lock variants, lab/gpufleet_lab/wheels.py, not a different index)."""
    return f"http://{controller_address()}:{WHEEL_PORT}/simple"


def wheel_links_url() -> str:
    """HTML directory listing for ``pip install --find-links``."""
    return f"http://{controller_address()}:{WHEEL_PORT}/wheels/"


def hf_mirror_url() -> str:
    return f"http://{controller_address()}:{HF_MIRROR_PORT}"


def registry_url() -> str:
    """The lab's registry, the hosts' registry mirror (plain HTTP: an insecure mirror)."""
    return f"http://{controller_address()}:{REGISTRY_PORT}"


def registry_config() -> Path:
    """docker-registry's configuration: the package's, without its htpasswd auth (the
    hosts pull anonymously), on the lab address, with deletes (a fault removes an image)."""
    path = SERVICE_DIR / "registry.yml"
    path.write_text(
        "version: 0.1\n"
        "log: {level: warn}\n"
        f"storage:\n  filesystem: {{rootdirectory: {REGISTRY_DIR}}}\n"
        "  delete: {enabled: true}\n"
        f"http: {{addr: '{controller_address()}:{REGISTRY_PORT}'}}\n")
    return path


def apt_proxy_url() -> str:
    return f"http://{controller_address()}:{APT_PROXY_PORT}"


def debian_mirror() -> str:
    """The controller's Debian mirror (deb822 sources), else deb.debian.org."""
    src = Path("/etc/apt/sources.list.d/debian.sources")
    if src.exists():
        for line in src.read_text().splitlines():
            if line.startswith("URIs:"):
                for uri in line.split()[1:]:
                    if "security" not in uri:
                        return uri
    return "http://deb.debian.org/debian"


# ---------------------------------------------------------------- wheel source


def project_of(filename: str) -> str | None:
    """Normalized project name of a wheel or sdist file name (PEP 503)."""
    if filename.endswith(".whl"):
        name = filename.split("-")[0]
    elif filename.endswith((".tar.gz", ".zip")):
        name = filename.rsplit("-", 1)[0]
    else:
        return None
    return re.sub(r"[-_.]+", "-", name).lower()


class WheelHandler(SimpleHTTPRequestHandler):
    """/simple/ and /simple/<project>/ (PEP 503) plus /wheels/ (a directory listing)."""

    hashes: dict[tuple[str, float, int], str] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=str(WHEEL_DIR), **kwargs)

    def log_message(self, fmt, *args):  # quiet: one line per request to the log file
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def _page(self, title: str, links: list[tuple[str, str]]) -> None:
        body = "".join(f'<a href="{html.escape(h)}">{html.escape(t)}</a><br>\n' for h, t in links)
        data = (
            f"<!DOCTYPE html><html><head><title>{html.escape(title)}</title></head>"
            f"<body>\n{body}</body></html>\n"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sha256(self, path: Path) -> str:
        st = path.stat()
        key = (str(path), st.st_mtime, st.st_size)
        if key not in self.hashes:
            self.hashes[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self.hashes[key]

    def _files(self) -> list[Path]:
        """The wheel source's files, and those of its real/ directory (wheels.REAL_DIR: the
        real engine's, some of them named as a stand-in; pip tells them apart by hash)."""
        dirs = [WHEEL_DIR] + [d for d in [WHEEL_DIR / "real"] if d.is_dir()]
        return sorted((p for d in dirs for p in d.iterdir()
                       if p.is_file() and project_of(p.name)), key=lambda p: p.name)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path in ("/", "/simple", "/wheels"):
            self.send_response(301)
            self.send_header("Location", "/wheels/" if path == "/wheels" else "/simple/")
            self.end_headers()
        elif path == "/simple/":
            names = sorted({project_of(p.name) for p in self._files()})
            self._page("Simple index", [(f"/simple/{n}/", n) for n in names])
        elif path.startswith("/simple/"):
            want = re.sub(r"[-_.]+", "-", path[len("/simple/") :].strip("/")).lower()
            files = [p for p in self._files() if project_of(p.name) == want]
            if not files:
                self.send_error(404, f"no such project: {want}")
                return
            self._page(
                f"Links for {want}",
                [(f"/wheels/{p.relative_to(WHEEL_DIR)}#sha256={self._sha256(p)}", p.name)
                 for p in files],
            )
        elif path.startswith("/wheels/"):
            self.path = self.path[len("/wheels") :]
            super().do_GET()
        else:
            self.send_error(404)


def serve_wheels(host: str, port: int = WHEEL_PORT) -> None:
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    ThreadingHTTPServer((host, port), WheelHandler).serve_forever()


# ---------------------------------------------------------------- processes


def _commands() -> dict[str, list[str]]:
    ctrl = controller_address()
    acng = SERVICE_DIR / "apt-cacher-ng"
    return {
        "apt-proxy": [
            "apt-cacher-ng",
            "-c",
            "/etc/apt-cacher-ng",
            "ForeGround=1",
            f"BindAddress={ctrl}",
            f"Port={APT_PROXY_PORT}",
            f"CacheDir={APT_CACHE_DIR}",
            f"LogDir={acng}",
            f"PidFile={acng}/pid",
            f"SocketPath={acng}/socket",
            "ExThreshold=30",
            # The packaged default backend may be unreachable; use the controller's mirror.
            f"Remap-debrep=file:deb_mirror*.gz /debian ; {debian_mirror().rstrip('/')}/",
        ],
        "wheels": [sys.executable, "-m", "gpufleet_lab.services", "serve-wheels", ctrl],
        "hf-mirror": [sys.executable, "-m", "gpufleet_lab.hfmirror", "--host", ctrl,
                      "--port", str(HF_MIRROR_PORT)],
        "registry": ["docker-registry", "serve", str(SERVICE_DIR / "registry.yml")],
    }


PORTS = {"apt-proxy": APT_PROXY_PORT, "wheels": WHEEL_PORT, "hf-mirror": HF_MIRROR_PORT,
         "registry": REGISTRY_PORT}
# in each command line; "hfmirror" also matches a mirror started before the lab left the
# gpufleet package (python -m gpufleet.lab.hfmirror), which then keeps serving
MARKERS = {"apt-proxy": "apt-cacher-ng", "wheels": "serve-wheels", "hf-mirror": "hfmirror",
           "registry": "docker-registry"}


def pid_alive(pid: int, marker: str = "") -> bool:
    """True if ``pid`` runs (not a zombie) and its command line contains ``marker``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and marker in cmdline


def _pid(name: str) -> int | None:
    try:
        pid = int((SERVICE_DIR / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid, MARKERS[name]) else None


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((controller_address(), port), timeout=1):
            return True
    except OSError:
        return False


def start() -> None:
    """Start the lab's services on the lab address (idempotent)."""
    SERVICE_DIR.mkdir(parents=True, exist_ok=True)
    (SERVICE_DIR / "apt-cacher-ng").mkdir(exist_ok=True)
    APT_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    registry_config()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LAB), str(REPO)])}
    for name, cmd in _commands().items():
        if _pid(name) and _listening(PORTS[name]):
            continue
        _stop(name)
        with open(SERVICE_DIR / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env=env,
                cwd=REPO,
            )
        (SERVICE_DIR / f"{name}.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + 15
        while not _listening(PORTS[name]):
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (SERVICE_DIR / f"{name}.log").read_text(errors="replace")[-1000:]
                raise LabError(
                    f"lab service {name} did not start: {' '.join(cmd)}\n{log}\n"
                    f"If port {PORTS[name]} is taken by a packaged daemon, stop it "
                    "(e.g. /etc/init.d/apt-cacher-ng stop)."
                )
            time.sleep(0.1)


def _stop(name: str) -> None:
    pid = _pid(name)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    (SERVICE_DIR / f"{name}.pid").unlink(missing_ok=True)


def stop() -> None:
    for name in _commands():
        _stop(name)


def running() -> dict[str, bool]:
    return {name: bool(_pid(name)) and _listening(PORTS[name]) for name in _commands()}


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "serve-wheels":
        serve_wheels(sys.argv[2] if len(sys.argv) > 2 else controller_address())
    else:
        sys.exit("usage: python -m gpufleet_lab.services serve-wheels [ADDRESS]")

"""The host health checker (gpufleet/host/healthcheck.py), run as the timer runs it.

Loopback only. The checker runs as a subprocess from an "installed" copy (healthcheck.py
next to gpu_facts.py, `python -I -S`: no site-packages, so stdlib only), against a tiny
HTTP engine in this process (healthy, wedged: /health 200 but generation hangs, or
failing) or a real stand-in vLLM, with fake `systemctl`, `nvidia-smi` and `journalctl`
on PATH: this machine has no systemd. The lab tests exercise the real systemd units,
timer and restarts on the lab hosts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import sysconfig
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
XML = REPO / "tests" / "fixtures" / "hardware" / "h200-1gpu" / "nvidia-smi-q.xml"
# the real 2x H200 (NV18): both GPUs' fabric Completed/Success, 18 links each
XML2 = REPO / "tests" / "fixtures" / "hardware" / "h200x2" / "nvidia-smi-q.xml"
NVLINK_S = XML2.parent / "nvlink-s.txt"
KEY = "sk-gpufleet-SECRET-3f9a1c"
UNIT = "gpufleet-router.service"
MODEL = "zai-org/GLM-5.3-Flash"

# ------------------------------------------------------------------------ fakes

FAKE_SYSTEMCTL = r'''
import json, os, sys, time
state_path, log = os.environ["FAKE_SYSTEMD"], os.environ["FAKE_SYSTEMD_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
units = json.load(open(state_path))
args = [a for a in sys.argv[1:] if not a.startswith("-")]
verb, name = args[0], args[-1]
u = units.get(name)
if verb == "show":
    if u is None:
        print("ActiveState=inactive\nLoadState=not-found\nNRestarts=0\n"
              "ActiveEnterTimestampMonotonic=0")
        sys.exit(0)
    entered = int((time.monotonic() - u["age"]) * 1e6) if u["state"] == "active" else 0
    print("ActiveEnterTimestampMonotonic=%d\nActiveState=%s\nLoadState=loaded\nNRestarts=%d\n"
          "UnitFileState=%s" % (entered, u["state"], u.get("nrestarts", 0),
                                "enabled" if u.get("enabled", True) else "disabled"))
elif verb == "is-active":
    print(u["state"] if u else "inactive")
    sys.exit(0 if u and u["state"] == "active" else 3)
elif verb == "restart":
    sys.exit(0 if u else 5)
elif verb in ("stop", "start"):
    if u is None:
        sys.exit(5)
    u.update(state="inactive" if verb == "stop" else "active", age=0)
    with open(state_path, "w") as f:
        json.dump(units, f)
'''
# -q -x from FAKE_NVIDIA_SMI_XML; nvlink -s / -e from the files next to it (none: the
# empty output of a GPU without NVLink, as on the real 1x H200)
FAKE_NVIDIA_SMI = r'''
import os, sys
xml = os.environ["FAKE_NVIDIA_SMI_XML"]
files = {("-q", "-x"): xml, ("nvlink", "-s"): xml + ".nvlink-s",
         ("nvlink", "-e"): xml + ".nvlink-e"}
path = files.get(tuple(sys.argv[1:]))
if path is None:
    sys.exit(9)
if os.path.exists(path):
    sys.stdout.write(open(path).read())
'''
# amd-smi CMD ... --json: FAKE_AMD_SMI/CMD.json (a missing file: the driver does not
# answer); every call's argv is logged to FAKE_AMD_SMI/argv
FAKE_AMD_SMI = r'''
import os, sys
d = os.environ["FAKE_AMD_SMI"]
with open(os.path.join(d, "argv"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
path = os.path.join(d, sys.argv[1] + ".json")
if sys.argv[-1] != "--json" or not os.path.exists(path):
    sys.stderr.write("AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded\n")
    sys.exit(1)
sys.stdout.write(open(path).read())
'''
# The installed checker with one of its functions replaced by one that raises, as a
# bug or an unexpected environment would (a TypeError took the host checks down once).
RAISING = r'''
import sys
lib, name = sys.argv[1], sys.argv[2]
sys.path.insert(0, lib)
import healthcheck

def boom(*args, **kwargs):
    raise TypeError("injected fault in " + name)

setattr(healthcheck, name, boom)
sys.exit(healthcheck.main(sys.argv[3:]))
'''
# journalctl -k -o json over the lines of FAKE_KERNEL_LOG (a file), journalctl -t TAG -o
# json over those of FAKE_TAG_LOGS/TAG.log (none: no entry): the cursor is a line number.
# FAKE_JOURNAL_HANG: -t hangs after its entries (a journal too big to read in one run)
FAKE_JOURNALCTL = r'''
import json, os, sys, time
with open(os.environ["FAKE_KERNEL_LOG_ARGV"], "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
# --cursor starts at the cursor's entry; a cursor "s=gone;line=N" names one whose journal
# file was removed: its reading starts at the entry after it (as systemd's does)
assert not [a for a in sys.argv if a.startswith("--after-cursor")], sys.argv
after = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--cursor=")]
start = int(after[0].split("line=")[1]) - (0 if after[0].startswith("s=gone;") else 1) \
    if after else 0
if "-t" in sys.argv:  # a syslog identifier's entries: the cursor's, else this boot's (-b)
    assert "-k" not in sys.argv and "json" in sys.argv, sys.argv
    assert ("-b" in sys.argv) != bool(after), sys.argv
    path = os.path.join(os.environ["FAKE_TAG_LOGS"], sys.argv[sys.argv.index("-t") + 1] + ".log")
else:
    assert "-k" in sys.argv and "json" in sys.argv, sys.argv
    path = os.environ["FAKE_KERNEL_LOG"]
lines = open(path).read().splitlines() if os.path.exists(path) else []


def show(n, line):
    if line.startswith("RAW "):  # output that is not journal JSON (a broken journalctl)
        print(line[4:], flush=True)
        return
    # a line starting "BYTES " is sent as journald sends a message that is not UTF-8
    message = list(line[6:].encode()) + [0xff] if line.startswith("BYTES ") else line
    print(json.dumps({"__CURSOR": "s=fake;line=%d" % n, "MESSAGE": message}), flush=True)


if "-f" in sys.argv:  # -f -n 0: what is appended from now on
    assert "-n" in sys.argv and "0" in sys.argv, sys.argv
    while True:
        time.sleep(0.05)
        now = open(path).read().splitlines()
        for n, line in enumerate(now[len(lines):], len(lines) + 1):
            show(n, line)
        lines = now
for n, line in enumerate(lines[start:], start + 1):
    show(n, line)
if os.environ.get("FAKE_JOURNAL_HANG") and "-t" in sys.argv:
    time.sleep(60)
'''


def nvlink_errors(gpus: int, links: int, **bump: int) -> str:
    """`nvidia-smi nvlink -e` text: every counter 0 except bump["g0_l3_replay"] = n."""
    lines = []
    for g in range(gpus):
        lines.append(f"GPU {g}: NVIDIA H200 (UUID: GPU-{g})")
        for link in range(links):
            for counter, name in (("replay", "Replay Errors"), ("recovery", "Recovery Errors"),
                                  ("crc", "CRC Errors")):
                lines.append(f"\t Link {link}: {name}: {bump.get(f'g{g}_l{link}_{counter}', 0)}")
    return "\n".join(lines) + "\n"


def write_tool(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text(f"#!{sys.executable} -S\n{body}")
    path.chmod(0o755)


# ------------------------------------------------------------------------ engine


class Engine:
    """A loopback OpenAI-style engine: mode ok, wedged (generation hangs) or error."""

    def __init__(self, key: str | None = KEY, tls: tuple | None = None):
        self.mode, self.key, self.requests = "ok", key, []
        self.release = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self.reply(500 if engine.mode == "error" else 200, {})
                self.reply(404, {"error": "not found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                engine.requests.append((self.path, dict(self.headers), body))
                if engine.key and self.headers.get("Authorization") != f"Bearer {engine.key}":
                    return self.reply(401, {"error": "Unauthorized"})
                if engine.mode == "wedged":
                    engine.release.wait(30)
                if engine.mode == "error":
                    return self.reply(500, {"error": "EngineDeadError"})
                self.reply(200, {"object": "text_completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "text": "!",
                                              "finish_reason": "length"}]})

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that left
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        scheme = "http"
        if tls:  # (certificate, key): HTTPS, as the gateway serves it
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        # a short poll: shutdown() waits for it, once per test
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    eng = Engine()
    yield eng
    eng.close()


# ------------------------------------------------------------------------ host


class Host:
    """An installed checker, its config, state, textfile and fake tools."""

    def __init__(self, root: Path):
        self.root = root
        lib = root / "lib"
        lib.mkdir()
        shutil.copy(REPO / "gpufleet" / "host" / "healthcheck.py", lib)
        shutil.copy(REPO / "gpufleet" / "module_utils" / "gpu_facts.py", lib)
        self.script = lib / "healthcheck.py"
        self.bin = root / "bin"
        self.bin.mkdir()
        write_tool(self.bin, "systemctl", FAKE_SYSTEMCTL)
        self.units_file = root / "units.json"
        self.systemctl_log = root / "systemctl.log"
        self.systemctl_log.touch()
        self.textfile = root / "textfile" / "gpufleet.prom"
        self.textfile.parent.mkdir()
        self.state = root / "state" / "health-state.json"
        self.state.parent.mkdir()
        self.cache = root / "cache"
        self.cache.mkdir()
        self.key_file = root / "api-key"
        self.key_file.write_text(KEY + "\n")
        self.key_file.chmod(0o600)
        self.config = root / "health.json"
        self.env = {"PATH": str(self.bin), "FAKE_SYSTEMD": str(self.units_file),
                    "FAKE_SYSTEMD_LOG": str(self.systemctl_log), "LANG": "C.UTF-8"}
        self.set_units({UNIT: {"state": "active", "age": 100000}})

    def set_units(self, units: dict) -> None:
        self.units_file.write_text(json.dumps(units))

    def nvidia_smi(self, xml: str) -> None:
        (self.root / "nvidia-smi.xml").write_text(xml)
        self.env["FAKE_NVIDIA_SMI_XML"] = str(self.root / "nvidia-smi.xml")
        write_tool(self.bin, "nvidia-smi", FAKE_NVIDIA_SMI)

    def amd_smi(self, docs: dict) -> None:
        """The fake amd-smi answers each command with docs[command] (JSON, or text)."""
        tool = self.root / "amd-smi"
        tool.mkdir(exist_ok=True)
        for old in tool.glob("*.json"):
            old.unlink()
        for command, doc in docs.items():
            text = doc if isinstance(doc, str) else json.dumps(doc)
            (tool / f"{command}.json").write_text(text)
        self.env["FAKE_AMD_SMI"] = str(tool)
        write_tool(self.bin, "amd-smi", FAKE_AMD_SMI)

    def journal(self, text: str) -> None:
        """Kernel log lines appended since the last run (the journal grows)."""
        log = self.root / "kernel.log"
        with log.open("a") as handle:
            handle.write(text)
        self.env["FAKE_KERNEL_LOG"] = str(log)
        self.env["FAKE_KERNEL_LOG_ARGV"] = str(self.root / "journalctl.argv")
        write_tool(self.bin, "journalctl", FAKE_JOURNALCTL)

    def gateway_log(self, text: str, tag: str = "gpufleet_gateway") -> None:
        """The gateway's access log lines appended since the last run (journal entries with
        SYSLOG_IDENTIFIER tag)."""
        folder = self.root / "tags"
        folder.mkdir(exist_ok=True)
        with (folder / f"{tag}.log").open("a") as handle:
            handle.write(text)
        self.env["FAKE_TAG_LOGS"] = str(folder)
        self.env["FAKE_KERNEL_LOG_ARGV"] = str(self.root / "journalctl.argv")
        self.env.setdefault("FAKE_KERNEL_LOG", str(self.root / "kernel.log"))
        write_tool(self.bin, "journalctl", FAKE_JOURNALCTL)

    def journal_argv(self, flag: str) -> list:
        """The journalctl calls with flag (-k: the Xid check's, -t: the gateway's)."""
        path = self.root / "journalctl.argv"
        calls = path.read_text().splitlines() if path.exists() else []
        return [c for c in calls if flag in c.split()]

    def nvlink(self, status: str, errors: str = "") -> None:
        (self.root / "nvidia-smi.xml.nvlink-s").write_text(status)
        (self.root / "nvidia-smi.xml.nvlink-e").write_text(errors)

    def write_config(self, engine: Engine | None = None, units: list | None = None,
                     **top) -> dict:
        if units is None:
            units = [unit_cfg(engine.url, self.key_file)]
        cfg = {"version": 1, "host": "workers-1", "units": units,
               "textfile": str(self.textfile), "state_file": str(self.state),
               "restart": {"after_failures": 3, "cooldown_s": 3600},
               "cache": {"path": str(self.cache), "min_free_gib": 0},
               "gpu": {"vendor": None}}
        cfg.update(top)
        self.config.write_text("# Ansible managed\n" + json.dumps(cfg, indent=2))
        return cfg

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", "-S", str(self.script), "--config",
                               str(self.config), *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def run_raising(self, name: str, *args: str) -> subprocess.CompletedProcess:
        """Run the checker with healthcheck.<name> replaced by a function that raises."""
        return subprocess.run([sys.executable, "-I", "-S", "-c", RAISING, str(self.script.parent),
                               name, "--config", str(self.config), *args], env=self.env,
                              capture_output=True, text=True, timeout=30)

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-I", "-S", str(self.script), "--config",
                                 str(self.config), *args], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def restarts(self) -> list:
        calls = [json.loads(line) for line in self.systemctl_log.read_text().splitlines()]
        return [c for c in calls if c and c[0] == "restart"]

    def metrics(self) -> dict:
        return parse_exposition(self.textfile.read_text())


def unit_cfg(url: str, key_file: Path | None, **extra) -> dict:
    out = {"unit": UNIT, "name": "router", "role": "router", "health_url": f"{url}/health",
           "generate_url": f"{url}/v1/completions", "served_name": MODEL,
           "api_key_file": str(key_file) if key_file else None, "health_timeout_s": 2,
           "generate_timeout_s": 2, "startup_grace_s": 60, "restart": True, "depends_on": []}
    out.update(extra)
    return out


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


# ------------------------------------------------------------------------ exposition

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf"^({NAME})(?:\{{(.*)\}})? (\S+)$")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"\s*(?:,|$)')
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def parse_exposition(text: str) -> dict:
    """Prometheus text format 0.0.4 -> {(name, ((label, value), ...)): float}.

    Strict: every sample belongs to a family with HELP and TYPE declared before it,
    families are contiguous, labels are well quoted, values are floats, the text ends
    with a newline, no sample is repeated.
    """
    assert text.endswith("\n"), "exposition must end with a newline"
    typed, helped, samples, done, current = {}, set(), {}, set(), None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(NAME, name) and name not in helped, line
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in TYPES and name not in typed and name in helped, line
            typed[name] = kind
            if current:
                done.add(current)
            current = name
        elif line.startswith("#") or not line.strip():
            continue
        else:
            match = SAMPLE.match(line)
            assert match, f"bad sample line: {line!r}"
            name, labels, value = match.groups()
            assert name == current and name not in done, f"{name} outside its family"
            pairs = []
            if labels:
                pos = 0
                while pos < len(labels):
                    lab = LABEL.match(labels, pos)
                    assert lab, f"bad labels: {labels!r}"
                    pairs.append((lab.group(1), lab.group(2)))
                    pos = lab.end()
            key = (name, tuple(sorted(pairs)))
            assert key not in samples, f"duplicate sample {line!r}"
            try:
                number = float(value)
            except ValueError:
                raise AssertionError(f"bad value: {line!r}") from None
            assert not math.isnan(number) or value == "NaN", line
            samples[key] = number
    return samples


def value(samples: dict, metric: str, /, **labels) -> float:
    key = (metric, tuple(sorted((k, str(v)) for k, v in labels.items())))
    assert key in samples, f"{key} not in metrics: {sorted(samples)}"
    return samples[key]


def test_exposition_parser_rejects_bad_text():
    good = '# HELP a x\n# TYPE a gauge\na{b="c"} 1\n'
    assert parse_exposition(good) == {("a", (("b", "c"),)): 1.0}
    for bad in ['# HELP a x\n# TYPE a gauge\na{b="c} 1\n', "# HELP a x\n# TYPE a gauge\na 1",
                "a 1\n", '# HELP a x\n# TYPE a gauge\na{b="c"} one\n']:
        with pytest.raises(AssertionError):
            parse_exposition(bad)


# ------------------------------------------------------------------------ tests


def assert_no_secret(host: Host, proc: subprocess.CompletedProcess) -> None:
    for where, text in [("stdout", proc.stdout), ("stderr", proc.stderr),
                        ("metrics", host.textfile.read_text()),
                        ("state", host.state.read_text() if host.state.exists() else ""),
                        ("systemctl argv", host.systemctl_log.read_text())]:
        assert KEY not in text, f"API key leaked into {where}"


def test_healthy_engine(host, engine):
    host.nvidia_smi(XML.read_text())
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 1})
    proc = host.run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = host.metrics()
    for check in ("active", "health", "generate"):
        assert value(m, "gpufleet_health_check_ok", check=check, unit=UNIT) == 1
    for check in ("gpu", "cache"):
        assert value(m, "gpufleet_health_check_ok", check=check, unit="") == 1
    assert value(m, "gpufleet_health_ok") == 1
    assert 0 < value(m, "gpufleet_generation_latency_seconds", unit=UNIT) < 2
    assert value(m, "gpufleet_cache_free_bytes", path=host.cache) > 0
    uuid = "GPU-" + re.search(r"<uuid>GPU-([^<]+)</uuid>", XML.read_text()).group(1)
    assert value(m, "gpufleet_gpu_ecc_uncorrected_errors", gpu=0, uuid=uuid,
                 counter="volatile") == 0
    assert value(m, "gpufleet_unit_restarts_total", unit=UNIT, by="healthcheck") == 0
    assert time.time() - value(m, "gpufleet_health_last_run_timestamp_seconds") < 30
    # one line per check, a real one-token generation with the key in a header
    assert re.search(rf"^OK +generate +{UNIT} ", proc.stdout, re.M)
    assert re.search(r"^OK +gpu +- .*1 GPUs", proc.stdout, re.M)
    path, headers, body = engine.requests[-1]
    assert path == "/v1/completions" and body["max_tokens"] == 1 and body["model"] == MODEL
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert_no_secret(host, proc)
    # journalctl absent: the Xid check says so, it does not pass by accident
    assert re.search(r"^NA +gpu_xid .*journalctl not found", proc.stdout, re.M)
    assert ("gpufleet_health_check_ok", (("check", "gpu_xid"), ("unit", ""))) not in m


def test_json_output_for_fab_health(host, engine):
    host.write_config(engine)
    proc = host.run("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # stdout is the JSON alone; log lines go to stderr
    assert report["healthy"] is True and report["exit_code"] == 0
    assert report["host"] == "workers-1"
    assert {(c["check"], c["status"]) for c in report["checks"]} >= {
        ("active", "ok"), ("health", "ok"), ("generate", "ok"), ("cache", "ok")}
    assert report["units"][UNIT]["active_state"] == "active"
    assert "OK   generate" in proc.stderr
    assert_no_secret(host, proc)


GPU_CHECKS = ["gpu", "gpu_ecc", "gpu_remap", "gpu_pcie", "gpu_clocks", "gpu_fabric",
              "gpu_nvlink"]
ALL_CHECKS = [("active", UNIT), ("health", UNIT), ("generate", UNIT)] + [
    (c, "") for c in GPU_CHECKS] + [("gpu_xid", ""), ("cache", "")]


@pytest.mark.parametrize("name,errors,message", [
    ("unit_status", [("active", UNIT)], "check raised TypeError: injected fault in unit_status"),
    ("check_active", [("active", UNIT)], "check raised TypeError: injected fault in check_active"),
    ("check_health", [("health", UNIT)], "check raised TypeError: injected fault in check_health"),
    ("check_generate", [("generate", UNIT)],
     "check raised TypeError: injected fault in check_generate"),
    ("check_nvidia", ALL_CHECKS[3:10], "check raised TypeError: injected fault in check_nvidia"),
    ("gpu_nvlink", [("gpu_nvlink", "")], "check raised TypeError: injected fault in gpu_nvlink"),
    ("check_xid", [("gpu_xid", "")], "check raised TypeError: injected fault in check_xid"),
    ("check_cache", [("cache", "")], "check raised TypeError: injected fault in check_cache"),
    # the thread itself dies: every check it owned still gets a result
    ("check_unit", ALL_CHECKS[:3], "gave no result (its thread ended early)"),
    ("host_checks", ALL_CHECKS[3:], "gave no result (its thread ended early)"),
])
def test_a_check_that_raises_is_an_error_never_a_pass(host, engine, name, errors, message):
    host.nvidia_smi(XML2.read_text())  # two GPUs on NVLink: every GPU check applies
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.journal("")
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True},
                      restart={"after_failures": 1})
    proc = host.run("--no-restart")
    assert proc.returncode == 0, proc.stdout  # every check passes without the fault
    assert not re.search(r"^NA ", proc.stdout, re.M), proc.stdout
    proc = host.run_raising(name, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["healthy"] is False and report["exit_code"] == 1
    statuses = {(c["check"], c["unit"]): c for c in report["checks"]}
    assert sorted(statuses) == sorted(ALL_CHECKS), "every configured check has a result"
    m = host.metrics()
    for check, unit in ALL_CHECKS:
        want = "error" if (check, unit) in errors else "ok"
        assert statuses[(check, unit)]["status"] == want, statuses[(check, unit)]
        for status in ("ok", "fail", "na", "error"):
            assert value(m, "gpufleet_health_check_status", check=check, unit=unit,
                         status=status) == (status == want)
        assert value(m, "gpufleet_health_check_ok", check=check, unit=unit) == (want == "ok")
        if want == "error":
            assert message in statuses[(check, unit)]["detail"]
            line = rf"^ERROR {check} +{unit or '-'} \S+ {re.escape(message)}"
            assert re.search(line, proc.stderr, re.M), proc.stderr
    assert value(m, "gpufleet_health_ok") == 0
    assert re.search(r"^workers-1: UNHEALTHY", proc.stderr, re.M)
    # a checker fault is no evidence against the engine: no restart, streak untouched
    assert host.restarts() == []
    if (errors[0][1]) == UNIT:
        assert "not counted: a check raised" in proc.stderr
        assert value(m, "gpufleet_unit_consecutive_failures", unit=UNIT) == 0


def test_wedged_engine_fails_within_timeout(host, engine):
    engine.mode = "wedged"
    host.write_config(engine, units=[unit_cfg(engine.url, host.key_file,
                                              generate_timeout_s=1)])
    started = time.monotonic()
    proc = host.run(timeout=20)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < 5, f"a wedged engine held the checker {elapsed:.1f}s"
    m = host.metrics()
    assert value(m, "gpufleet_health_check_ok", check="health", unit=UNIT) == 1
    assert value(m, "gpufleet_health_check_ok", check="generate", unit=UNIT) == 0
    assert value(m, "gpufleet_health_ok") == 0
    assert re.search(rf"^FAIL generate +{UNIT} .*timed out", proc.stdout, re.M)
    assert_no_secret(host, proc)


def test_wrong_api_key_is_a_failure_and_not_printed(host, engine):
    engine.key = "sk-the-right-one"
    host.write_config(engine)
    proc = host.run()
    assert proc.returncode == 1
    assert re.search(r"^FAIL generate .*answered 401", proc.stdout, re.M)
    assert_no_secret(host, proc)


def test_restart_after_n_failures_once_per_cooldown(host, engine):
    engine.mode = "error"
    host.write_config(engine)
    for run in (1, 2):
        assert host.run().returncode == 1
        assert host.restarts() == [], f"restarted after {run} failures"
    proc = host.run()
    assert proc.returncode == 1
    assert host.restarts() == [["restart", "--no-block", UNIT]]
    assert "restart requested after 3 consecutive failures" in proc.stdout
    assert value(host.metrics(), "gpufleet_unit_restarts_total", unit=UNIT,
                 by="healthcheck") == 1
    # the unit keeps failing: the streak builds up again, the cooldown holds
    for _ in range(4):
        proc = host.run()
    assert len(host.restarts()) == 1
    assert re.search(r"failure 4: restarted \d+s ago, cooldown 3600s", proc.stdout)
    # once the cooldown has passed, the next failure restarts it again
    state = json.loads(host.state.read_text())
    state["units"][UNIT]["last_restart"] -= 3601
    host.state.write_text(json.dumps(state))
    host.run()
    assert len(host.restarts()) == 2
    assert_no_secret(host, proc)


def test_no_restart_during_startup_window(host, engine):
    engine.mode = "error"
    host.write_config(engine)
    for state in ({"state": "active", "age": 5}, {"state": "activating", "age": 0}):
        host.set_units({UNIT: state})
        for _ in range(5):
            proc = host.run()
            assert proc.returncode == 1
        assert host.restarts() == []
        assert "in start-up window" in proc.stdout
        m = host.metrics()
        assert value(m, "gpufleet_unit_in_startup_window", unit=UNIT) == 1
        assert value(m, "gpufleet_unit_consecutive_failures", unit=UNIT) == 0
    # past the grace period the streak starts from zero
    host.set_units({UNIT: {"state": "active", "age": 61}})
    host.run()
    host.run()
    assert host.restarts() == []
    host.run()
    assert len(host.restarts()) == 1


def self_signed(folder: Path) -> tuple:
    """A self-signed certificate for 127.0.0.1 (its own CA), made by openssl."""
    folder.mkdir()
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def test_an_https_health_url_is_verified_with_its_ca(host, tmp_path):
    """The gateway over TLS: healthy with the deployment's CA, failed (naming the
    certificate) with another one, never passed unverified."""
    gateway_unit = "gpufleet-gateway.service"
    pair, other = self_signed(tmp_path / "ours"), self_signed(tmp_path / "other")
    gateway = Engine(tls=pair)
    try:
        host.set_units({gateway_unit: {"state": "active", "age": 1000}})
        for ca, healthy in ((pair[0], True), (other[0], False)):
            host.write_config(units=[{"unit": gateway_unit, "name": "gateway",
                                      "role": "gateway", "health_url": gateway.url + "/health",
                                      "ca_file": ca, "restart": False}])
            proc = host.run("--json")
            report = json.loads(proc.stdout)
            check = next(c for c in report["checks"] if c["check"] == "health")
            assert (check["status"] == "ok") is healthy, check
            if not healthy:
                assert "certificate verify failed" in check["detail"], check
    finally:
        gateway.close()


def test_stopped_unit_and_failing_dependency_are_not_restarted(host, engine):
    engine.mode = "error"
    decode = "gpufleet-decode.service"
    host.set_units({UNIT: {"state": "active", "age": 1000}})  # decode: not loaded
    host.write_config(units=[
        unit_cfg(engine.url, host.key_file, depends_on=[decode]),
        {"unit": decode, "health_url": engine.url + "/health"}])
    for _ in range(4):
        proc = host.run()
    assert host.restarts() == []
    assert f"not counted: depends on unhealthy {decode}" in proc.stdout
    assert "LoadState=not-found" in proc.stdout
    assert re.search(rf"{decode} failure 4: inactive, not restarting", proc.stdout)


def test_imex_down_on_a_tray_is_named_with_its_fix_and_never_restarted(host, engine):
    """A GB200 tray's nvidia-imex stopped (the units as gpufleet_health_config writes them):
    its check fails with the fix; the checker never restarts it, and the engine that
    depends on it failing meanwhile is not counted."""
    engine.mode = "error"
    imex = "nvidia-imex.service"
    host.set_units({UNIT: {"state": "active", "age": 1000}, imex: {"state": "failed", "age": 0}})
    host.write_config(units=[
        unit_cfg(engine.url, host.key_file, depends_on=[imex]),
        {"unit": imex, "name": "nvidia-imex", "role": "host", "restart": False,
         "fix": "start it (systemctl start nvidia-imex.service; its journal says why it "
                "stopped)"}], restart={"after_failures": 1, "cooldown_s": 0})
    for _ in range(3):
        proc = host.run()
        assert proc.returncode == 1
    assert re.search(r"^FAIL active +nvidia-imex.service .*ActiveState=failed\. Fix: start it "
                     r"\(systemctl start nvidia-imex.service", proc.stdout, re.M), proc.stdout
    assert f"not counted: depends on unhealthy {imex}" in proc.stdout
    assert host.restarts() == []


def test_no_restart_flag_observes_only(host, engine):
    engine.mode = "error"
    host.write_config(engine, restart={"after_failures": 1})
    proc = host.run("--no-restart")
    assert proc.returncode == 1
    assert "would restart (--no-restart)" in proc.stdout
    assert host.restarts() == [] and not host.state.exists()


def test_textfile_replaced_atomically(host, engine):
    host.write_config(engine)
    assert host.run().returncode == 0
    # readers that opened an older version keep a whole file (an in-place rewrite
    # would truncate it under them); holding them open also keeps inodes from reuse
    handles = [host.textfile.open()]
    seen, errors, stop = [], [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                text = host.textfile.read_text()
                parse_exposition(text)
                assert "gpufleet_health_last_run_timestamp_seconds " in text
                seen.append(len(text))
            except AssertionError as exc:
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(5):
            assert host.run().returncode == 0
            handles.append(host.textfile.open())
    finally:
        stop.set()
        thread.join()
    assert not errors, f"a reader saw a partial file: {errors[0]}"
    assert len(seen) > 10
    assert len({os.fstat(h.fileno()).st_ino for h in handles}) == 6, "rewritten in place"
    for handle in handles:
        parse_exposition(handle.read())
        handle.close()
    assert sorted(p.name for p in host.textfile.parent.iterdir()) == ["gpufleet.prom"]


def test_kill_9_leaves_state_and_metrics_whole(host, engine):
    host.write_config(engine)
    assert host.run().returncode == 0
    before = host.textfile.read_text(), host.state.read_text()
    engine.mode = "wedged"
    host.write_config(engine, units=[unit_cfg(engine.url, host.key_file,
                                              generate_timeout_s=20)])
    proc = host.popen()
    time.sleep(1.0)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (host.textfile.read_text(), host.state.read_text()) == before
    engine.release.set()
    engine.mode = "ok"
    assert host.run().returncode == 0
    # a state file damaged by hand does not stop the checker
    host.state.write_text('{"units": ')
    proc = host.run()
    assert proc.returncode == 0 and "unreadable" in proc.stdout
    assert json.loads(host.state.read_text())["units"][UNIT]["consecutive_failures"] == 0


def edit_gpu0(xml: str, old: str, new: str) -> str:
    assert old in xml
    return xml.replace(old, new, 1)


GPU1 = "GPU 1 (GPU-fda287b8-4d96-ad0b-7f3d-0efabb9894f4, 00000000:00:07.0)"


def edit_gpu1(xml: str, old: str, new: str) -> str:
    """The real 2x H200 capture with one change in GPU 1's block."""
    head, gpu1 = xml.split("<gpu id=\"00000000:00:07.0\">")
    assert old in gpu1, old
    return head + "<gpu id=\"00000000:00:07.0\">" + gpu1.replace(old, new, 1)


# fault in GPU 1 of the real 2x H200 capture -> the check that fails, what it says
GPU_FAULTS = {
    "uncorrectable ECC": ("<dram_uncorrectable>0</dram_uncorrectable>",
                          "<dram_uncorrectable>2</dram_uncorrectable>", "gpu_ecc",
                          "2 uncorrected ECC errors since the driver loaded. Action: drain the "
                          "host and reset the GPU (nvidia-smi -r -i 1)"),
    "remap pending": ("<remapped_row_pending>No</remapped_row_pending>",
                      "<remapped_row_pending>Yes</remapped_row_pending>", "gpu_remap",
                      "row remapping pending. Action: drain the host and reset the GPU"),
    "remap failed": ("<remapped_row_failure>No</remapped_row_failure>",
                     "<remapped_row_failure>Yes</remapped_row_failure>", "gpu_remap",
                     "row remapping failed. Action: replace the GPU (RMA)"),
    "PCIe at x8": ("<current_link_width>16x</current_link_width>",
                   "<current_link_width>8x</current_link_width>", "gpu_pcie",
                   "PCIe link x8 of x16. Action: reseat the GPU"),
    "PCIe gen 3 while busy": (
        "<clocks_event_reason_gpu_idle>Active</clocks_event_reason_gpu_idle>",
        "<clocks_event_reason_gpu_idle>Not Active</clocks_event_reason_gpu_idle>"
        "<!-- --><current_link_gen>3</current_link_gen>", "gpu_pcie",
        "PCIe gen 3 of 5 while busy"),
    "HW slowdown": ("<clocks_event_reason_hw_slowdown>Not Active<",
                    "<clocks_event_reason_hw_slowdown>Active<", "gpu_clocks",
                    "hardware slowdown (over temperature or a power brake). Action: check"),
    "thermal": ("<clocks_event_reason_hw_thermal_slowdown>Not Active<",
                "<clocks_event_reason_hw_thermal_slowdown>Active<", "gpu_clocks",
                "hardware thermal slowdown. Action: check the GPU's cooling"),
    "power brake": ("<clocks_event_reason_hw_power_brake_slowdown>Not Active<",
                    "<clocks_event_reason_hw_power_brake_slowdown>Active<", "gpu_clocks",
                    "power brake slowdown"),
    "fabric Insufficient Resources": ("<status>Success</status>",
                                      "<status>Insufficient Resources</status>", "gpu_fabric",
                                      "fabric Completed/Insufficient Resources. Action: the "
                                      "fabric is managed outside this host"),
}


@pytest.mark.parametrize("fault", sorted(GPU_FAULTS))
def test_gpu_fault_matrix(host, engine, fault):
    """Each fault in one GPU of the real 2x H200 capture: exactly its check fails, naming
    the GPU (index, UUID, PCI address) and the action; the engine is left alone."""
    old, new, check, message = GPU_FAULTS[fault]
    xml = XML2.read_text()
    if "<!-- -->" in new:  # two edits
        first, second = new.split("<!-- -->")
        xml = edit_gpu1(xml, old, first)
        xml = edit_gpu1(xml, "<current_link_gen>5</current_link_gen>", second)
    else:
        xml = edit_gpu1(xml, old, new)
    host.nvidia_smi(xml)
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True})
    proc = host.run()
    assert proc.returncode == 1, proc.stdout
    failed = re.findall(r"^FAIL (\S+) +- \S+ (.*)$", proc.stdout, re.M)
    assert [c for c, _ in failed] == [check], proc.stdout
    assert failed[0][1].startswith(GPU1 + ": ") and message in failed[0][1], failed[0][1]
    m = host.metrics()
    assert value(m, "gpufleet_health_check_ok", check=check, unit="") == 0
    assert value(m, "gpufleet_health_check_ok", check="generate", unit=UNIT) == 1
    assert host.restarts() == []


def test_gpu_metrics_from_the_real_capture(host, engine):
    host.nvidia_smi(edit_gpu1(XML2.read_text(), "<current_link_width>16x</current_link_width>",
                              "<current_link_width>8x</current_link_width>"))
    host.nvlink(NVLINK_S.read_text().replace("Link 17: 26.562 GB/s", "Link 17: <inactive>", 1),
                nvlink_errors(2, 18))
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True})
    proc = host.run()
    m = host.metrics()
    uuid0, uuid1 = "GPU-2d3d9486-4ce1-0b89-abc8-58be76664d0c", GPU1.split(" ")[2][1:-1]
    assert value(m, "gpufleet_gpu_info", gpu=1, uuid=uuid1, pci="00000000:00:07.0",
                 name="NVIDIA H200") == 1
    assert value(m, "gpufleet_gpu_pcie_link_width", gpu=1, uuid=uuid1, which="current") == 8
    assert value(m, "gpufleet_gpu_pcie_link_width", gpu=0, uuid=uuid0, which="current") == 16
    assert value(m, "gpufleet_gpu_pcie_link_gen", gpu=1, uuid=uuid1, which="max") == 5
    assert value(m, "gpufleet_gpu_temperature_celsius", gpu=1, uuid=uuid1) == 37
    assert value(m, "gpufleet_gpu_fabric_ok", gpu=1, uuid=uuid1) == 1
    assert value(m, "gpufleet_gpu_clock_event_active", gpu=0, uuid=uuid0,
                 reason="hw_slowdown") == 0
    assert value(m, "gpufleet_gpu_remap_failed", gpu=0, uuid=uuid0) == 0
    assert value(m, "gpufleet_gpu_remapped_rows", gpu=0, uuid=uuid0, kind="uncorrectable") == 0
    assert value(m, "gpufleet_gpu_nvlink_links", gpu=0, uuid=uuid0, state="active") == 17
    assert value(m, "gpufleet_gpu_nvlink_links", gpu=0, uuid=uuid0, state="inactive") == 1
    assert value(m, "gpufleet_gpu_nvlink_links", gpu=1, uuid=uuid1, state="active") == 18
    assert re.search(r"^FAIL gpu_nvlink +- \S+ GPU 0 \(GPU-2d3d9486-\S+ 00000000:00:06.0\): "
                     r"NVLink 17 inactive \(17 of 18 active\)\. Action: reset the GPU",
                     proc.stdout, re.M), proc.stdout


def test_nvlink_error_counters_fail_on_a_rise_not_on_their_level(host, engine):
    host.nvidia_smi(XML2.read_text())
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18, g0_l3_replay=5000))
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True})
    first = host.run()
    assert first.returncode == 0, first.stdout  # a level from before: the baseline
    assert value(host.metrics(), "gpufleet_gpu_nvlink_errors", gpu=0,
                 uuid="GPU-2d3d9486-4ce1-0b89-abc8-58be76664d0c", counter="replay") == 5000
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18, g0_l3_replay=5050))
    assert host.run().returncode == 0  # +50: under the replay limit (100)
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18, g0_l3_replay=5050,
                                                    g1_l0_recovery=1))
    proc = host.run()
    assert proc.returncode == 1
    assert re.search(rf"^FAIL gpu_nvlink +- \S+ {re.escape(GPU1)}: NVLink recovery errors "
                     r"rose by 1 since the last run \(more than 0\)\. Action:", proc.stdout, re.M)
    assert host.run().returncode == 0  # no further rise: green again
    # the limits are the operator's
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True,
                                   "nvlink_error_delta_max": {"replay": 10}})
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18, g0_l3_replay=5070,
                                                    g1_l0_recovery=1))
    proc = host.run()
    assert proc.returncode == 1 and "NVLink replay errors rose by 20" in proc.stdout


def test_no_nvlink_is_not_applicable_and_a_broken_tool_fails(host, engine):
    host.nvidia_smi(XML.read_text())  # the real 1x H200: nvlink -s prints nothing
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 1})
    proc = host.run()
    assert proc.returncode == 0 and re.search(r"^NA +gpu_nvlink .*no NVLink", proc.stdout, re.M)
    assert re.search(r"^NA +gpu_fabric .*not on an NVSwitch fabric", proc.stdout, re.M)
    write_tool(host.bin, "nvidia-smi", "import sys, os\nif sys.argv[1:2] == ['nvlink']:\n"
               "    print('Unable to query NVLink: Unknown Error'); sys.exit(255)\n"
               "sys.stdout.write(open(os.environ['FAKE_NVIDIA_SMI_XML']).read())\n")
    proc = host.run()
    assert proc.returncode == 1
    assert re.search(r"^FAIL gpu_nvlink .*nvidia-smi nvlink -s: Unable to query NVLink",
                     proc.stdout, re.M)


def test_lifetime_ecc_errors_are_exported_but_not_unhealthy(host, engine):
    xml = XML.read_text()
    agg = xml.index("<aggregate>")
    xml = xml[:agg] + edit_gpu0(xml[agg:], "<dram_uncorrectable>0</dram_uncorrectable>",
                                "<dram_uncorrectable>7</dram_uncorrectable>")
    host.nvidia_smi(xml)
    host.write_config(engine, gpu={"vendor": "nvidia"})
    assert host.run().returncode == 0
    m = host.metrics()
    assert [v for (name, labels), v in m.items() if name == "gpufleet_gpu_ecc_uncorrected_errors"
            and ("counter", "aggregate") in labels] == [7.0]


def test_gpu_tools_missing_or_broken(host, engine):
    # the plan says NVIDIA but the driver tool is gone: unhealthy, not "no GPU, fine"
    host.write_config(engine, gpu={"vendor": "nvidia"})
    proc = host.run()
    assert proc.returncode == 1 and "nvidia-smi not found" in proc.stdout
    # a router-only host without GPUs: not applicable, no ok metric either way
    host.write_config(engine, gpu={"vendor": None})
    proc = host.run()
    assert proc.returncode == 0 and re.search(r"^NA +gpu ", proc.stdout, re.M)
    assert not any(k[0] == "gpufleet_health_check_ok" and ("check", "gpu") in k[1]
                   for k in host.metrics())
    # the driver does not answer
    write_tool(host.bin, "nvidia-smi", "import sys\nprint('NVIDIA-SMI has failed because it "
               "couldn\\'t communicate with the NVIDIA driver.')\nsys.exit(9)\n")
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 8})
    proc = host.run()
    assert proc.returncode == 1 and "couldn't communicate with the NVIDIA driver" in proc.stdout
    # fewer GPUs than the plan uses (one fell off the bus)
    host.nvidia_smi(XML.read_text())
    proc = host.run()
    assert proc.returncode == 1 and "1 GPUs visible, 8 expected" in proc.stdout


AMD_CHECKS = ["gpu", "gpu_ecc", "gpu_thermal", "gpu_xgmi"]


def amd_docs(gpus: int = 2) -> dict:
    """Two MI300X as amd-smi 25.x (ROCm 6.4) answers list, static, metric -e -k -t and
    xgmi -l: XGMI link status per port, the eighth port disabled."""
    zero = {"correctable_count": 0, "uncorrectable_count": 0, "deferred_count": 0}
    bdf = [f"0000:{0x0c + 0x10 * i:02x}:00.0" for i in range(gpus)]
    return {
        "list": [{"gpu": i, "bdf": bdf[i], "uuid": f"{i}cff74a1-0000-1000-80ee-e2c0b0c0d0e{i}",
                  "kfd_id": 1000 + i, "node_id": i + 1, "partition_id": 0}
                 for i in range(gpus)],
        "static": {"gpu_data": [
            {"gpu": i, "asic": {"market_name": "AMD Instinct MI300X", "vendor_id": "0x1002",
                                "asic_serial": f"0x5A4B3C2D1E0F00{i:02X}"},
             "bus": {"bdf": bdf[i], "max_pcie_width": 16},
             "ras": {"eeprom_version": "0x30000", "parity_schema": "DISABLED",
                     "single_bit_schema": "DISABLED", "double_bit_schema": "DISABLED",
                     "poison_schema": "ENABLED",
                     "ecc_block_state": {"UMC": "ENABLED", "GFX": "ENABLED",
                                         "XGMI_WAFL": "ENABLED"}}}
            for i in range(gpus)]},
        "metric": {"gpu_data": [
            {"gpu": i, "temperature": {"edge": "N/A", "hotspot": {"value": 52 + i, "unit": "C"},
                                       "mem": {"value": 40, "unit": "C"}},
             "ecc": {"total_correctable_count": 0, "total_uncorrectable_count": 0,
                     "total_deferred_count": 0, "cache_correctable_count": 0,
                     "cache_uncorrectable_count": 0},
             "ecc_blocks": {"UMC": dict(zero), "GFX": dict(zero), "XGMI_WAFL": dict(zero)}}
            for i in range(gpus)]},
        "xgmi": {"link_status": [{"gpu": i, "bdf": bdf[i], "link_status": ["U"] * 7 + ["X"]}
                                 for i in range(gpus)]},
    }


def amd_run(host: Host, docs: dict, **gpu) -> tuple[subprocess.CompletedProcess, dict]:
    host.amd_smi(docs)
    host.write_config(None, units=[], gpu={"vendor": "amd", "count": 2, **gpu})
    proc = host.run("--json")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc, {c["check"]: c for c in json.loads(proc.stdout)["checks"]}


def test_amd_gpus_healthy_and_their_metrics(host):
    proc, checks = amd_run(host, amd_docs())
    assert proc.returncode == 0, checks
    assert {c: checks[c]["status"] for c in AMD_CHECKS} == dict.fromkeys(AMD_CHECKS, "ok")
    assert "nvidia" not in proc.stderr.lower()
    assert checks["gpu"]["detail"] == ("2 GPUs: 0 0cff74a1-0000-1000-80ee-e2c0b0c0d0e0 "
                                       "0000:0c:00.0, 1 1cff74a1-0000-1000-80ee-e2c0b0c0d0e1 "
                                       "0000:1c:00.0")
    assert checks["gpu_thermal"]["detail"] == "hotspot at most 53 C (limit 100 C)"
    assert checks["gpu_xgmi"]["detail"].startswith("14 XGMI links up on 2 GPUs")
    argv = (host.root / "amd-smi" / "argv").read_text().splitlines()
    assert argv == ["list --json", "static --json",
                    "metric --ecc --ecc-blocks --temperature --json", "xgmi --link-status --json"]
    m = host.metrics()
    uuid = "1cff74a1-0000-1000-80ee-e2c0b0c0d0e1"
    assert value(m, "gpufleet_gpu_info", gpu="1", uuid=uuid, pci="0000:1c:00.0",
                 name="AMD Instinct MI300X") == 1
    assert value(m, "gpufleet_gpu_temperature_celsius", gpu="1", uuid=uuid) == 53
    assert value(m, "gpufleet_gpu_ecc_uncorrected_errors", gpu="1", uuid=uuid,
                 counter="volatile") == 0
    assert value(m, "gpufleet_gpu_ras_errors", gpu="1", uuid=uuid, block="UMC",
                 kind="deferred") == 0
    assert value(m, "gpufleet_gpu_xgmi_links", gpu="1", uuid=uuid, state="up") == 7
    assert value(m, "gpufleet_gpu_xgmi_links", gpu="1", uuid=uuid, state="disabled") == 1
    assert value(m, "gpufleet_host_fault", check="gpu_xgmi") == 0
    # what AMD has nothing alike for is absent, not 0
    assert not any(k[0] in ("gpufleet_gpu_remap_pending", "gpufleet_gpu_pcie_link_width",
                            "gpufleet_gpu_fabric_ok") for k in m)


def test_amd_faults_name_the_gpu_and_the_action(host):
    docs = amd_docs()
    gpu1 = docs["metric"]["gpu_data"][1]
    gpu1["ecc_blocks"]["UMC"]["uncorrectable_count"] = 2
    gpu1["ecc_blocks"]["XGMI_WAFL"]["uncorrectable_count"] = 1
    gpu1["temperature"]["hotspot"]["value"] = 96
    docs["static"]["gpu_data"][0]["ras"]["ecc_block_state"]["GFX"] = "POISON"
    docs["xgmi"]["link_status"][0]["link_status"][2:4] = ["D", "D"]
    proc, checks = amd_run(host, docs, temperature_max_c=95)
    assert proc.returncode == 1
    name0 = "GPU 0 (0cff74a1-0000-1000-80ee-e2c0b0c0d0e0, 0000:0c:00.0)"
    name1 = "GPU 1 (1cff74a1-0000-1000-80ee-e2c0b0c0d0e1, 0000:1c:00.0)"
    assert checks["gpu_ecc"]["detail"] == (
        f"{name0}: RAS block GFX reports POISON. Action: drain the host and reset the GPU "
        "(amd-smi reset --gpureset -g 0); replace it if it comes back; "
        f"{name1}: 2 uncorrectable ECC errors in UMC since the driver loaded. Action: drain "
        "the host and reset the GPU (amd-smi reset --gpureset -g 1); replace it if they come "
        "back")
    assert checks["gpu_thermal"]["detail"].startswith(
        f"{name1}: hotspot 96 C, above 95 C. Action: check the GPU's cooling")
    xgmi = checks["gpu_xgmi"]["detail"]
    assert xgmi.startswith(f"{name0}: XGMI link 2, 3 down (5 of 7 up). Action: reset the GPU "
                           "(amd-smi reset --gpureset -g 0) or reboot")
    assert f"{name1}: 1 uncorrectable XGMI errors (RAS block XGMI_WAFL)" in xgmi
    for check in ("gpu_ecc", "gpu_thermal", "gpu_xgmi"):
        assert checks[check]["status"] == "fail"
        assert all("Action: " in part for part in checks[check]["detail"].split("; G"))
    assert checks["gpu"]["status"] == "ok"
    report = json.loads(proc.stdout)
    assert report["host_fault"] == ["gpu_ecc", "gpu_xgmi"]  # thermal: no drain, like clocks
    m = host.metrics()
    assert value(m, "gpufleet_gpu_xgmi_links", gpu="0",
                 uuid="0cff74a1-0000-1000-80ee-e2c0b0c0d0e0", state="down") == 2
    assert value(m, "gpufleet_gpu_ecc_uncorrected_errors", gpu="1",
                 uuid="1cff74a1-0000-1000-80ee-e2c0b0c0d0e1", counter="volatile") == 0


def test_amd_older_shapes_and_what_is_not_reported(host):
    """ROCm 6.x before 6.4: bare lists; ecc_blocks and temperatures N/A (a VM guest); no
    XGMI (PCIe-only GPUs): totals still count, the rest does not apply."""
    docs = amd_docs()
    docs["static"] = docs["static"]["gpu_data"]
    docs["metric"] = docs["metric"]["gpu_data"]
    for entry in docs["metric"]:
        entry["ecc_blocks"] = "N/A"
        entry["temperature"] = {"edge": "N/A", "hotspot": "N/A", "mem": "N/A"}
    docs["metric"][1]["ecc"]["total_uncorrectable_count"] = 4
    docs["xgmi"] = {"link_status": [{"gpu": i, "bdf": "x", "link_status": "N/A"}
                                    for i in range(2)]}
    proc, checks = amd_run(host, docs)
    assert checks["gpu_ecc"]["status"] == "fail"
    assert checks["gpu_ecc"]["detail"].startswith(
        "GPU 1 (1cff74a1-0000-1000-80ee-e2c0b0c0d0e1, 0000:1c:00.0): 4 uncorrectable ECC "
        "errors since the driver loaded. Action: drain the host and reset the GPU")
    assert checks["gpu_thermal"]["status"] == "na"
    assert checks["gpu_xgmi"] == dict(checks["gpu_xgmi"], status="na",
                                      detail="no XGMI links on these GPUs")
    docs["metric"][1]["ecc"]["total_uncorrectable_count"] = "N/A"
    docs["metric"][0]["ecc"]["total_uncorrectable_count"] = "N/A"
    proc, checks = amd_run(host, docs)
    assert checks["gpu_ecc"]["status"] == "na" and proc.returncode == 0


def test_amd_tools_missing_broken_or_fewer_gpus(host):
    host.write_config(None, units=[], gpu={"vendor": "amd"})
    proc = host.run()
    assert proc.returncode == 1
    assert re.search(r"^FAIL gpu +- \S+ amd-smi not found, but this host's plan uses AMD GPUs\. "
                     r"Action: install ROCm", proc.stdout, re.M), proc.stdout
    assert re.search(r"^NA +gpu_xgmi +- \S+ no data: amd-smi not found", proc.stdout, re.M)
    docs = amd_docs()
    del docs["metric"]  # the driver stops answering between two commands
    proc, checks = amd_run(host, docs)
    assert checks["gpu"]["status"] == "fail"
    assert checks["gpu"]["detail"] == (
        "amd-smi metric --ecc --ecc-blocks --temperature: AMDSMI_STATUS_DRIVER_NOT_LOADED - "
        "Driver not loaded. Action: check the amdgpu driver (dmesg), reboot if it does not "
        "answer")
    docs = amd_docs(gpus=1)
    proc, checks = amd_run(host, docs)
    assert checks["gpu"]["status"] == "fail"
    assert checks["gpu"]["detail"].startswith("1 GPUs visible, 2 expected. Action: a GPU fell "
                                              "off the bus")
    docs = amd_docs()
    del docs["xgmi"]
    proc, checks = amd_run(host, docs)
    assert [c for c in AMD_CHECKS if checks[c]["status"] != "ok"] == ["gpu_xgmi"]
    assert checks["gpu_xgmi"]["detail"].startswith("amd-smi xgmi --link-status: AMDSMI_STATUS")


@pytest.mark.parametrize("name,errors", [
    ("check_amd", AMD_CHECKS),
    ("amd_xgmi", ["gpu_xgmi"]),
    ("amd_gpus", AMD_CHECKS),
])
def test_an_amd_check_that_raises_is_an_error_never_a_pass(host, name, errors):
    host.amd_smi(amd_docs())
    host.write_config(None, units=[], gpu={"vendor": "amd", "count": 2})
    assert host.run().returncode == 0
    proc = host.run_raising(name, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = {c["check"]: c for c in json.loads(proc.stdout)["checks"]}
    for check in AMD_CHECKS:
        assert checks[check]["status"] == ("error" if check in errors else "ok"), checks[check]
    assert f"check raised TypeError: injected fault in {name}" in checks[errors[0]]["detail"]
    assert value(host.metrics(), "gpufleet_health_check_ok", check=errors[0], unit="") == 0


def test_amd_smi_output_that_is_not_json_is_an_error(host):
    docs = amd_docs()
    docs["metric"] = "WARNING: AMD SMI is in a degraded state\n{"
    proc, checks = amd_run(host, docs)
    assert proc.returncode == 1
    assert {checks[c]["status"] for c in AMD_CHECKS} == {"error"}
    assert "check raised JSONDecodeError" in checks["gpu_ecc"]["detail"]
    docs = amd_docs()
    docs["xgmi"] = "not json"
    proc, checks = amd_run(host, docs)
    assert [c for c in AMD_CHECKS if checks[c]["status"] == "error"] == ["gpu_xgmi"]


def test_fatal_xid_is_read_once_and_stays_red_until_reset_or_reboot(host, engine):
    boot = host.root / "boot_id"
    boot.write_text("boot-1\n")
    host.env["GPUFLEET_TEST_BOOT_ID"] = str(boot)  # read by the installed copy below
    src = host.script.read_text()
    host.script.write_text(src.replace('BOOT_ID = "/proc/sys/kernel/random/boot_id"',
                                       'BOOT_ID = os.environ["GPUFLEET_TEST_BOOT_ID"]'))
    host.nvidia_smi(XML2.read_text())
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.journal("NVRM: Xid (PCI:0000:00:07): 13, pid=1234, Graphics Exception\n")
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True})
    proc = host.run()
    assert proc.returncode == 0, proc.stdout  # Xid 13: an application fault, counted
    assert value(host.metrics(), "gpufleet_gpu_xid_events_total", pci="0000:00:07", xid=13) == 1
    host.journal("NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus.\n")
    for _ in range(7):  # many runs later (a time window would have forgotten it)
        proc = host.run()
        assert proc.returncode == 1
    assert re.search(rf"^FAIL gpu_xid +- \S+ Xid 79 on {re.escape(GPU1)} \(1x since .*\)\. "
                     r"Action: the GPU fell off the bus: reboot the host", proc.stdout, re.M)
    m = host.metrics()
    assert value(m, "gpufleet_gpu_xid_fatal", pci="0000:00:07", xid=79) == 1
    # each event was read exactly once: the cursor moved on
    assert value(m, "gpufleet_gpu_xid_events_total", pci="0000:00:07", xid=13) == 1
    assert value(m, "gpufleet_gpu_xid_events_total", pci="0000:00:07", xid=79) == 1
    argv = (host.root / "journalctl.argv").read_text().splitlines()
    assert "--cursor" not in argv[0] and all("--cursor=s=fake;line=" in a for a in argv[1:])
    # fab health (--no-restart) sees it too, and moves nothing
    assert host.run("--no-restart").returncode == 1
    # the operator resets the GPU and clears it
    proc = host.run("--clear-xid", "0000:00:05.0")
    assert proc.returncode == 1 and "recorded: 0000:00:07" in proc.stdout
    proc = host.run("--clear-xid", "00000000:00:07.0")
    assert proc.returncode == 0 and "cleared the fatal Xids of 0000:00:07" in proc.stdout
    assert host.run().returncode == 0
    assert ("gpufleet_gpu_xid_fatal", (("pci", "0000:00:07"), ("xid", "79"))) not in \
        host.metrics()
    # a new one (in a message journald holds as bytes), then a reboot: the old boot's Xids
    # are gone, the new boot's log is read
    host.journal("BYTES NVRM: Xid (PCI:0000:00:06): 48, pid=0, DBE\n")
    proc = host.run()
    assert proc.returncode == 1 and "Xid 48 on GPU 0 (" in proc.stdout
    boot.write_text("boot-2\n")
    (host.root / "kernel.log").write_text("")
    proc = host.run()
    assert proc.returncode == 0, proc.stdout
    assert value(host.metrics(), "gpufleet_health_check_ok", check="gpu_xid", unit="") == 1
    # output the check cannot read is never a pass: an error (the journal's trouble, not a
    # GPU's: no drain); the entries around it are still read
    host.journal("RAW <journal file corrupted>\n"
                 "NVRM: Xid (PCI:0000:00:07): 13, pid=1, Graphics Exception\n")
    proc = host.run()
    assert proc.returncode == 1, proc.stdout
    assert re.search(r"^ERROR gpu_xid .*1 line\(s\) that are not journal JSON \(first: "
                     r"'<journal file corrupted>'\)", proc.stdout, re.M), proc.stdout
    assert value(host.metrics(), "gpufleet_gpu_xid_events_total", pci="0000:00:07", xid=13) == 1


def xid_events(host: Host) -> dict:
    return {dict(labels).get("pci", "(none)") + " " + dict(labels)["xid"]: n
            for (name, labels), n in host.metrics().items()
            if name == "gpufleet_gpu_xid_events_total"}


def test_xid_events_are_counted_per_gpu(host, engine):
    """gpufleet_gpu_xid_events_total{pci, xid}: the GPU is the PCI address the Xid message
    names, written as gpufleet_gpu_xid_fatal writes it; the OK detail names it too."""
    host.nvidia_smi(XML2.read_text())
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.journal("NVRM: Xid (PCI:0000:00:07): 13, pid=1234, Graphics Exception\n"
                 "NVRM: Xid (PCI:0000:00:06): 13, pid=1234, Graphics Exception\n"
                 "NVRM: Xid (PCI:0000:00:07): 13, pid=1235, Graphics Exception\n"
                 "NVRM: Xid (PCI:0000:00:06): 31, pid=1236, MMU Fault\n")
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True})
    proc = host.run()
    assert proc.returncode == 0, proc.stdout
    assert xid_events(host) == {"0000:00:06 13": 1, "0000:00:06 31": 1, "0000:00:07 13": 2}
    assert re.search(r"^OK +gpu_xid .*no fatal Xid this boot \(Xid 13 x1 on 0000:00:06, "
                     r"Xid 31 x1 on 0000:00:06, Xid 13 x2 on 0000:00:07\)", proc.stdout, re.M)
    host.journal("NVRM: Xid (PCI:0000:00:06): 13, pid=1237, Graphics Exception\n")
    assert host.run().returncode == 0
    assert xid_events(host) == {"0000:00:06 13": 2, "0000:00:06 31": 1, "0000:00:07 13": 2}
    state = json.loads(host.state.read_text())
    assert state["gpu"]["xid_counts"] == {"0000:00:06": {"13": 2, "31": 1},
                                          "0000:00:07": {"13": 2}}


def test_an_old_state_files_xid_counts_start_over_per_gpu(host, engine):
    """A state file of the checker before per-GPU counts ({code: n}) neither crashes the run
    nor is read as per-GPU counts: those start over; the cursor is kept (nothing is read
    twice) and so are the fatal Xids (already per GPU)."""
    host.journal("NVRM: Xid (PCI:0000:00:07): 13, pid=1234, Graphics Exception\n")
    host.write_config(engine)
    assert host.run().returncode == 0
    state = json.loads(host.state.read_text())
    state["gpu"]["xid_counts"] = {"13": 1, "31": 4}  # as the old checker wrote it
    host.state.write_text(json.dumps(state))
    assert host.run().returncode == 0
    assert xid_events(host) == {}  # the old counts are gone, the event not read again
    host.journal("NVRM: Xid (PCI:0000:00:07): 31, pid=1235, MMU Fault\n")
    proc = host.run()
    assert proc.returncode == 0, proc.stdout
    assert xid_events(host) == {"0000:00:07 31": 1}
    assert json.loads(host.state.read_text())["gpu"]["xid_counts"] == {"0000:00:07": {"31": 1}}


def test_a_cursor_whose_entry_is_gone_misses_no_later_entry(host, engine):
    """The journal file holding the kept cursor's entry was removed (vacuumed, or by hand):
    the next Xid and gateway line after it are still read, each once (journalctl
    --after-cursor skipped the first entry past a cursor whose entry is gone)."""
    host.journal("NVRM: Xid (PCI:0000:00:07): 13, pid=1234, Graphics Exception\n")
    host.gateway_log('10.0.0.1 "GET /health HTTP/1.1" 200 2 0.000\n')
    host.write_config(engine, gateway=GATEWAY)
    assert host.run().returncode == 0
    state = json.loads(host.state.read_text())
    assert state["gpu"]["journal_cursor"] == state["gateway"]["journal_cursor"] == "s=fake;line=1"
    # the fake's "s=gone" cursor names an entry no file holds any more, at the same place
    state["gpu"]["journal_cursor"] = state["gateway"]["journal_cursor"] = "s=gone;line=1"
    host.state.write_text(json.dumps(state))
    host.journal("NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus.\n")
    host.gateway_log('10.0.0.1 "POST /v1/completions HTTP/1.1" 503 0 0.1\n')
    assert host.run().returncode == 1
    assert xid_events(host) == {"0000:00:07 13": 1, "0000:00:07 79": 1}
    assert responses(host) == {"200": 1, "503": 1, "unparsed": 0}
    assert host.run().returncode == 1  # read once: the cursor names the new entries now
    assert xid_events(host) == {"0000:00:07 13": 1, "0000:00:07 79": 1}
    assert responses(host) == {"200": 1, "503": 1, "unparsed": 0}


GATEWAY = {"log_tag": "gpufleet_gateway"}


def responses(host: Host) -> dict:
    """The gateway's counters: {code: n}, and "unparsed": n (absent: no such series)."""
    out = {}
    for (name, labels), n in host.metrics().items():
        if name == "gpufleet_gateway_responses_total":
            out[dict(labels)["code"]] = n
        elif name == "gpufleet_gateway_log_unparsed_total":
            out["unparsed"] = n
    return out


def gateway_result(proc: subprocess.CompletedProcess) -> dict:
    (found,) = [c for c in json.loads(proc.stdout)["checks"] if c["check"] == "gateway_log"]
    return found


def test_gateway_responses_are_counted_by_status_code_once_across_runs(host, engine):
    """The gateway's access log (journalctl -t gpufleet_gateway) read from a cursor in the
    state file: every response counted once by its status code, read from the end of the
    line (the request line may hold quotes and spaces); a line not in the log format counts
    as unparsed. The counters add up across runs (each run is a new process)."""
    host.gateway_log('10.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 512 0.034\n'
                     '10.0.0.2 "GET /v1/models HTTP/1.1" 401 60 0.001\n'
                     '10.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 1024 1.250\n')
    host.gateway_log("some other program's line\n", tag="other")  # not the gateway's
    host.write_config(engine, gateway=GATEWAY)
    proc = host.run()
    assert proc.returncode == 0, proc.stdout
    assert re.search(r"^OK +gateway_log +- \S+ 3 responses since the last run: 200 x2, "
                     r"401 x1$", proc.stdout, re.M), proc.stdout
    assert responses(host) == {"200": 2, "401": 1, "unparsed": 0}
    assert value(host.metrics(), "gpufleet_health_check_ok", check="gateway_log", unit="") == 1
    host.gateway_log('10.0.0.3 "GET /v1/x?q="a b" \\"c HTTP/1.1" 404 0 0.000\n'
                     '10.0.0.3 "" 400 0 0.000\n'
                     'upstream said "hello" 200\n'
                     '10.0.0.1 "POST /v1/completions HTTP/1.1" 200 77 0.5\n')
    proc = host.run("--json")
    assert proc.returncode == 0, proc.stderr
    assert gateway_result(proc)["detail"] == (
        "3 responses since the last run: 200 x1, 400 x1, 404 x1; 1 line(s) not in the "
        "gateway's log format (counted as unparsed)")
    assert responses(host) == {"200": 3, "400": 1, "401": 1, "404": 1, "unparsed": 1}
    proc = host.run()  # nothing new: nothing counted again
    assert re.search(r"^OK +gateway_log .* 0 responses since the last run$", proc.stdout, re.M)
    assert responses(host) == {"200": 3, "400": 1, "401": 1, "404": 1, "unparsed": 1}
    calls = host.journal_argv("-t")
    assert len(calls) == 3 and all("-t gpufleet_gateway -o json" in c for c in calls)
    assert " -b" in calls[0] and "--cursor" not in calls[0]
    assert calls[1].endswith("--cursor=s=fake;line=3") and " -b" not in calls[1]
    assert calls[2].endswith("--cursor=s=fake;line=7")
    state = json.loads(host.state.read_text())["gateway"]
    assert state == {"journal_cursor": "s=fake;line=7", "unparsed": 1,
                     "responses": {"200": 3, "400": 1, "401": 1, "404": 1}}
    # observing only (fab health) counts on a copy: the next run counts the same entries
    host.gateway_log('10.0.0.1 "GET /health HTTP/1.1" 200 2 0.000\n')
    assert host.run("--no-restart").returncode == 0
    assert responses(host)["200"] == 4
    assert host.run().returncode == 0
    assert responses(host)["200"] == 4


def test_gateway_log_trouble_is_an_error_never_a_fail(host, engine):
    """journalctl failing, missing or printing what is not journal JSON: an error (the
    checker's own trouble: no drain, no held restart), the entries around it still counted
    and the counters kept; a journal too big for one run is read on by the next."""
    drain_host(host, engine, after_runs=1)
    cfg = json.loads(host.config.read_text().split("\n", 1)[1])
    cfg["gateway"] = GATEWAY
    host.config.write_text(json.dumps(cfg))
    host.gateway_log('10.0.0.1 "POST /v1/completions HTTP/1.1" 200 5 0.1\n')
    assert host.run().returncode == 0
    write_tool(host.bin, "journalctl", FAILING_JOURNALCTL)
    for _ in range(2):
        proc = host.run("--json")
        report = json.loads(proc.stdout)
        assert proc.returncode == 1 and report["host_fault"] == [] and report["drained"] == []
    found = gateway_result(proc)
    assert found["status"] == "error" and "Bad message" in found["detail"], found
    assert "journalctl -t gpufleet_gateway: Failed to get journal" in found["detail"]
    assert responses(host) == {"200": 1, "unparsed": 0}  # the counters stay
    assert value(host.metrics(), "gpufleet_health_check_status", check="gateway_log", unit="",
                 status="error") == 1
    (host.bin / "journalctl").unlink()
    proc = host.run("--json")
    assert gateway_result(proc)["status"] == "error"
    assert "journalctl not found" in gateway_result(proc)["detail"]
    assert json.loads(proc.stdout)["host_fault"] == []
    host.gateway_log("RAW <journal file corrupted>\n"
                     '10.0.0.1 "POST /v1/completions HTTP/1.1" 503 5 0.1\n')
    proc = host.run("--json")
    found = gateway_result(proc)
    assert proc.returncode == 1 and found["status"] == "error", found
    assert "1 line(s) that are not journal JSON (first: '<journal file corrupted>')" in \
        found["detail"] and "1 responses since the last run: 503 x1" in found["detail"]
    assert responses(host) == {"200": 1, "503": 1, "unparsed": 0}
    assert stops_starts(host) == []
    # a journal that takes longer than a run may read: what was read is counted, the next
    # run reads on from there; one that gives nothing at all is an error
    src = host.script.read_text()
    host.script.write_text(src.replace("GATEWAY_READ_S = 20", "GATEWAY_READ_S = 1"))
    host.env["FAKE_JOURNAL_HANG"] = "1"
    host.gateway_log('10.0.0.1 "POST /v1/completions HTTP/1.1" 200 5 0.1\n' * 3)
    proc = host.run("--json")
    found = gateway_result(proc)
    assert found["status"] == "ok" and found["detail"] == (
        "3 responses since the last run: 200 x3 (read for 1s: the next run reads on)"), found
    proc = host.run("--json")
    found = gateway_result(proc)
    assert found["status"] == "error" and "gave nothing within 1s" in found["detail"], found
    assert responses(host) == {"200": 4, "503": 1, "unparsed": 0}


def test_no_gateway_config_reads_no_gateway_log(host, engine):
    """No gateway on the host (no `gateway` in the config, or null): no job, no result, no
    gateway metrics, no journalctl -t."""
    host.gateway_log('10.0.0.1 "POST /v1/completions HTTP/1.1" 200 5 0.1\n')
    for gateway in ({}, {"gateway": None}):
        host.write_config(engine, **gateway)
        proc = host.run("--json")
        assert proc.returncode == 0, proc.stderr
        assert "gateway_log" not in {c["check"] for c in json.loads(proc.stdout)["checks"]}
        assert "gpufleet_gateway" not in host.textfile.read_text()
        assert host.journal_argv("-t") == []
        assert json.loads(host.state.read_text())["gateway"] == {}


def write_ib_port(root: Path, hca: str, state="4: ACTIVE", phys="5: LinkUp",
                  rate="400 Gb/sec (4X NDR)", **counters: int) -> None:
    """One HCA port as sysfs shows it (/sys/class/infiniband/<hca>/ports/1)."""
    port = root / hca / "ports" / "1"
    (port / "counters").mkdir(parents=True, exist_ok=True)
    for name, text in (("state", state), ("phys_state", phys), ("rate", rate),
                       ("link_layer", "InfiniBand")):
        (port / name).write_text(text + "\n")
    for name in ("link_downed", "link_error_recovery", "symbol_error", "port_rcv_errors"):
        (port / "counters" / name).write_text(f"{counters.get(name, 0)}\n")


def test_infiniband_ports_of_the_kv_path(host, engine):
    sysfs = host.root / "infiniband"
    for i in range(4):
        write_ib_port(sysfs, f"mlx5_{i}")
    host.write_config(engine, ib={"sysfs": str(sysfs)})
    proc = host.run()
    assert proc.returncode == 0, proc.stdout
    assert re.search(r"^OK +ib +- .*4 ports ACTIVE/LinkUp at 400 Gb/s", proc.stdout, re.M)
    m = host.metrics()
    assert value(m, "gpufleet_ib_port_up", hca="mlx5_2", port=1) == 1
    assert value(m, "gpufleet_ib_port_rate_gbps", hca="mlx5_2", port=1) == 400
    # a port down, one trained at half its rate, one whose link went down and came back
    write_ib_port(sysfs, "mlx5_1", state="1: DOWN", phys="3: Disabled")
    write_ib_port(sysfs, "mlx5_2", rate="200 Gb/sec (4X HDR)")
    write_ib_port(sysfs, "mlx5_3", link_downed=1, symbol_error=40)
    proc = host.run()
    assert proc.returncode == 1
    line = re.search(r"^FAIL ib +- \S+ (.*)$", proc.stdout, re.M).group(1)
    assert "HCA mlx5_1 port 1: DOWN (physical Disabled). Action: check the cable" in line
    assert "HCA mlx5_2 port 1: 200 Gb/s, expected 400. Action:" in line
    assert "HCA mlx5_3 port 1: link_downed rose by 1 since the last run (more than 0)" in line
    assert "symbol_error" not in line  # +40: under its limit
    m = host.metrics()
    assert value(m, "gpufleet_ib_port_up", hca="mlx5_1", port=1) == 0
    assert value(m, "gpufleet_ib_port_errors", hca="mlx5_3", port=1, counter="link_downed") == 1
    # the operator's rate; the plan's HCAs missing altogether
    host.write_config(engine, ib={"sysfs": str(sysfs), "min_rate_gbps": 800})
    assert "expected 800" in host.run().stdout
    host.write_config(engine, ib={"sysfs": str(host.root / "none")})
    proc = host.run()
    assert proc.returncode == 1 and "no InfiniBand/RoCE device under" in proc.stdout


def wait_for(what, predicate, timeout: float, proc=None):
    """Seconds until predicate() holds; fails naming what did not happen."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        with contextlib.suppress(FileNotFoundError, KeyError, AssertionError):
            if predicate():
                return time.monotonic() - started
        time.sleep(0.05)
    out = ""
    if proc is not None:
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
    raise AssertionError(f"{what}: not within {timeout}s\n{out}")


def check_ok(host: Host, check: str, unit: str = "") -> float:
    return value(host.metrics(), "gpufleet_health_check_ok", check=check, unit=unit)


def test_watcher_sees_xid_fabric_and_hca_faults_within_seconds(host, engine):
    """--watch: a fatal Xid (followed in the kernel log), the fabric status (polled through
    nvidia-smi here: no NVML) and an HCA port (sysfs) show in the metrics within seconds;
    the units' results stay those of the timer's last full run and nothing is restarted."""
    sysfs = host.root / "infiniband"
    write_ib_port(sysfs, "mlx5_0")
    host.nvidia_smi(XML2.read_text())
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.journal("")
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True},
                      ib={"sysfs": str(sysfs)}, watch={"interval_s": 0.5})
    assert host.run().returncode == 0  # the timer's run: the units' results
    first = host.textfile.stat().st_mtime_ns
    engine.close()  # a unit failing now is the timer's business, not the watcher's
    proc = host.popen("--watch")
    try:
        wait_for("the watcher's first run", lambda: host.textfile.stat().st_mtime_ns > first,
                 10, proc)
        assert check_ok(host, "generate", UNIT) == 1
        faults = (
            ("HCA port down", "ib", lambda: write_ib_port(sysfs, "mlx5_0", state="1: DOWN",
                                                          phys="3: Disabled")),
            ("fabric status", "gpu_fabric", lambda: host.nvidia_smi(edit_gpu1(
                XML2.read_text(), "<status>Success</status>",
                "<status>Insufficient Resources</status>"))),
            ("fatal Xid", "gpu_xid", lambda: host.journal(
                "NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus.\n")),
        )
        for name, check, inject in faults:
            inject()
            took = wait_for(name, lambda c=check: check_ok(host, c) == 0, 5, proc)
            print(f"{name}: in the metrics after {took:.2f}s")
        m = host.metrics()
        assert value(m, "gpufleet_host_fault", check="gpu_xid") == 1
        assert value(m, "gpufleet_health_check_ok", check="generate", unit=UNIT) == 1
        fault = json.loads(host.state.read_text())["host_fault"]  # what fab status shows
        assert fault["checks"] == ["gpu_fabric", "gpu_xid", "ib"] and fault["since"] > 0
    finally:
        # the watcher's children (its journalctl): stopped with it
        children = [int(pid) for task in Path(f"/proc/{proc.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert children, "the watcher follows the kernel log with journalctl"
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f"{pid} left running"
    assert "watch: every 0.5s: GPUs through nvidia-smi -q -x, HCA ports from sysfs" in out
    assert "watch: running the host checks (Xid in the kernel log)" in out, out
    assert re.search(r"watch: running the host checks \(.*ib", out), out
    assert host.restarts() == []


def test_watcher_reads_nvml_when_it_loads(host):
    """The NVML poll's signature: return codes and values; a GPU lost changes it."""
    spec = importlib.util.spec_from_file_location("hc", host.script)
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    assert hc.Nvml.open("libnvidia-ml-absent.so.1") is None  # no driver: nvidia-smi instead

    class Lib:
        lost = False

        def nvmlDeviceGetCount_v2(self, count):
            count._obj.value = 1
            return 0

        def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
            return 15 if self.lost else 0  # NVML_ERROR_GPU_IS_LOST

        def __getattr__(self, name):
            return lambda *args: 3  # NVML_ERROR_NOT_SUPPORTED

    lib = Lib()
    nvml = hc.Nvml(lib)
    before = nvml.signature()
    assert before[0] == ("count", 0, 1) and before[1][0] == 0
    assert nvml.signature() == before
    lib.lost = True
    assert nvml.signature() != before and nvml.signature()[1] == (0, 15)


def test_a_sick_gpu_holds_restarts_until_it_is_fixed(host, engine):
    """An engine failing on a GPU that fell off the bus: restarting it cannot help, so the
    checker counts nothing and says to drain the host; once the fault is cleared, the
    failures count again."""
    engine.mode = "error"
    host.nvidia_smi(XML2.read_text())
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.journal("NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus.\n")
    host.write_config(engine, gpu={"vendor": "nvidia", "count": 2, "fabric": True},
                      restart={"after_failures": 1, "cooldown_s": 0})
    for _ in range(3):
        proc = host.run("--json")
        assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["host_fault"] == ["gpu_xid"]
    assert "not counted: the host is sick (gpu_xid failed)" in report["units"][UNIT]["restart"]
    assert "restarts held while gpu_xid fails: fix what the check names" in proc.stderr
    assert host.restarts() == []
    m = host.metrics()
    assert value(m, "gpufleet_host_fault", check="gpu_xid") == 1
    assert value(m, "gpufleet_host_fault", check="gpu_ecc") == 0
    assert value(m, "gpufleet_unit_consecutive_failures", unit=UNIT) == 0
    fault = json.loads(host.state.read_text())["host_fault"]  # fab status reads it
    assert fault["checks"] == ["gpu_xid"]
    assert host.run().returncode == 1  # sick since the first run that saw it
    assert json.loads(host.state.read_text())["host_fault"] == fault
    # the GPU was reset: the engine's failures are its own again, and restart it
    assert host.run("--clear-xid", "all").returncode == 0
    proc = host.run("--json")
    assert json.loads(proc.stdout)["host_fault"] == []
    assert "host_fault" not in json.loads(host.state.read_text())
    assert len(host.restarts()) == 1, proc.stderr


def test_a_sick_host_drains_its_engines_and_starts_them_once_healthy(host, engine):
    """A fatal Xid: the checker stops the host's engine units (routers route around a
    stopped worker; Dynamo's deregisters), leaves the router alone, says so in its JSON,
    state and metrics; observing runs and health_drain off stop nothing; once the GPU is
    reset it starts exactly the units it stopped."""
    decode = "gpufleet-decode.service"
    host.set_units({UNIT: {"state": "active", "age": 100000},
                    decode: {"state": "active", "age": 100000}})
    host.nvidia_smi(XML2.read_text())
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.journal("NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus.\n")
    units = [unit_cfg(engine.url, host.key_file),
             unit_cfg(engine.url, None, unit=decode, name="decode", role="decode", drain=True,
                      generate_url=None, served_name=None)]
    gpu = {"vendor": "nvidia", "count": 2, "fabric": True}

    def calls(verb):
        return [c for c in map(json.loads, host.systemctl_log.read_text().splitlines())
                if c[0] == verb]

    host.write_config(units=units, gpu=gpu, drain=False)
    assert host.run().returncode == 1
    # at once, both ways (the hysteresis: test_a_flapping_fault_drains_once_per_cooldown)
    host.write_config(units=units, gpu=gpu,
                      drain={"after_runs": 1, "return_after_runs": 1, "cooldown_s": 0})
    assert host.run("--no-restart").returncode == 1  # fab health observes only
    assert calls("stop") == []
    proc = host.run("--json")
    report = json.loads(proc.stdout)
    assert report["host_fault"] == ["gpu_xid"] and report["drained"] == [decode]
    assert calls("stop") == [["stop", "--no-block", decode]]
    assert "engines stopped (drained): " + decode in proc.stderr
    assert json.loads(host.state.read_text())["drained"] == [decode]  # fab status reads it
    m = host.metrics()
    assert value(m, "gpufleet_unit_drained", unit=decode) == 1
    assert ("gpufleet_unit_drained", (("unit", UNIT),)) not in m  # the router is not an engine
    assert host.run().returncode == 1 and len(calls("stop")) == 1  # stopped once
    assert host.restarts() == []
    # the GPU was reset: the unit it stopped starts again, and nothing else
    assert host.run("--clear-xid", "all").returncode == 0
    proc = host.run("--json")
    assert json.loads(proc.stdout)["drained"] == []
    assert calls("start") == [["start", "--no-block", decode]]
    assert "drained" not in json.loads(host.state.read_text())
    assert value(host.metrics(), "gpufleet_unit_drained", unit=decode) == 0
    assert f"drain {decode}: the host is healthy again, started" in proc.stderr


def test_the_fabric_state_of_a_stopped_fabric_manager_holds_restarts_but_drains_nothing(
        host, engine):
    """The fabric manager stopped: the GPUs' fabric state leaves Completed, yet the running
    engines keep serving and, stopped, could not start until it is back: restarts held, its
    check names the fix, no engine stopped. The same fabric state with the manager running
    is a fabric fault: the host is drained."""
    fm, decode = "nvidia-fabricmanager.service", "gpufleet-decode.service"
    host.set_units({UNIT: {"state": "active", "age": 100000},
                    decode: {"state": "active", "age": 100000},
                    fm: {"state": "inactive", "age": 0}})
    host.nvidia_smi(XML2.read_text().replace("<state>Completed</state>",
                                             "<state>In Progress</state>"))
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    units = [unit_cfg(engine.url, host.key_file, depends_on=[fm]),
             unit_cfg(engine.url, None, unit=decode, name="decode", role="decode", drain=True,
                      generate_url=None, served_name=None, depends_on=[fm]),
             {"unit": fm, "name": "nvidia-fabricmanager", "role": "host", "restart": False,
              "fix": "start it"}]
    host.write_config(units=units, gpu={"vendor": "nvidia", "count": 2, "fabric": True},
                      drain={"after_runs": 1})
    proc = host.run("--json")
    report = json.loads(proc.stdout)
    assert report["host_fault"] == ["gpu_fabric"] and report["drained"] == [], proc.stderr
    assert [c for c in map(json.loads, host.systemctl_log.read_text().splitlines())
            if c[0] in ("stop", "start", "restart")] == []
    host.set_units({UNIT: {"state": "active", "age": 100000},
                    decode: {"state": "active", "age": 100000},
                    fm: {"state": "active", "age": 100000}})
    assert json.loads(host.run("--json").stdout)["drained"] == [decode]


DECODE = "gpufleet-decode.service"


def drain_host(host, engine, fabric_ok=True, **drain):
    """A host with a router and a decode engine whose GPU fabric is formed (fabric_ok) or not
    (a host fault that drains); returns the systemctl stop/start calls so far."""
    units = host.units_file.exists() and json.loads(host.units_file.read_text()) or {}
    units.setdefault(UNIT, {"state": "active", "age": 100000})
    units.setdefault(DECODE, {"state": "active", "age": 100000})
    host.set_units(units)
    xml = XML2.read_text()
    host.nvidia_smi(xml if fabric_ok else xml.replace("<state>Completed</state>",
                                                      "<state>In Progress</state>"))
    host.nvlink(NVLINK_S.read_text(), nvlink_errors(2, 18))
    host.write_config(units=[unit_cfg(engine.url, host.key_file),
                             unit_cfg(engine.url, None, unit=DECODE, name="decode",
                                      role="decode", drain=True, generate_url=None,
                                      served_name=None)],
                      gpu={"vendor": "nvidia", "count": 2, "fabric": True, "timeout_s": 1},
                      drain=dict({"after_runs": 2, "return_after_runs": 2, "cooldown_s": 3600},
                                 **drain))


def stops_starts(host) -> list:
    return [c[0] for c in map(json.loads, host.systemctl_log.read_text().splitlines())
            if c[0] in ("stop", "start")]


def age_last_change(host, seconds: float) -> None:
    """The last drain or return happened `seconds` earlier (the cooldown's clock)."""
    state = json.loads(host.state.read_text())
    state["drain_runs"]["last"]["at"] -= seconds
    host.state.write_text(json.dumps(state))


def test_a_flapping_fault_drains_once_per_cooldown(host, engine):
    """A fault must hold for after_runs runs in a row before the engines stop, and be gone
    for return_after_runs before they start; neither change comes within cooldown_s of the
    last one the other way: a fault that comes and goes on every run costs one stop and
    one start per cooldown, not one per run (each start reloads the checkpoint)."""
    drain_host(host, engine, fabric_ok=False)
    proc = host.run()
    assert stops_starts(host) == [], proc.stdout
    assert "gpu_fabric failed in 1 of the 2 runs in a row that drain the host" in proc.stdout
    drain_host(host, engine, fabric_ok=True)  # it passes once: the count starts over
    host.run()
    drain_host(host, engine, fabric_ok=False)
    host.run()
    assert stops_starts(host) == []
    host.run()
    assert stops_starts(host) == ["stop"]  # two in a row
    assert json.loads(host.state.read_text())["drained"] == [DECODE]
    # gone, back, gone, gone: the flapping fault starts nothing within the cooldown
    for ok in (True, False, True, True, True):
        drain_host(host, engine, fabric_ok=ok)
        proc = host.run()
    assert stops_starts(host) == ["stop"], proc.stdout
    assert "the host is healthy; engines start later: " in proc.stdout
    assert "after the last drain, cooldown 3600s" in proc.stdout
    age_last_change(host, 3601)
    host.run()
    assert stops_starts(host) == ["stop", "start"]
    # and a fault right after the return drains nothing within the cooldown either
    drain_host(host, engine, fabric_ok=False)
    host.run()
    proc = host.run()
    assert stops_starts(host) == ["stop", "start"]
    assert "not draining yet: " in proc.stdout and "after the last return" in proc.stdout
    age_last_change(host, 3601)
    host.run()
    assert stops_starts(host) == ["stop", "start", "stop"]


SLOW_NVIDIA_SMI = "import time\ntime.sleep(5)\n"
FAILING_JOURNALCTL = "import sys\nsys.stderr.write('Failed to get journal: Bad message\\n')\n" \
                     "sys.exit(1)\n"


def test_the_checkers_own_tool_trouble_is_an_error_never_a_drain(host, engine):
    """nvidia-smi slower than the GPU timeout and journalctl failing are the checker's
    trouble, not the GPUs': an error (its own alert: GpufleetHealthCheckError, exit 1),
    restarts not held, nothing stopped however often it happens."""
    drain_host(host, engine, after_runs=1)
    write_tool(host.bin, "nvidia-smi", SLOW_NVIDIA_SMI)
    host.journal("")
    write_tool(host.bin, "journalctl", FAILING_JOURNALCTL)
    for _ in range(3):
        proc = host.run("--json", timeout=60)
        report = json.loads(proc.stdout)
        assert proc.returncode == 1 and report["host_fault"] == [] and report["drained"] == []
    status = {c["check"]: c for c in report["checks"] if not c["unit"]}
    assert status["gpu"]["status"] == "error", status["gpu"]
    assert "timed out after 1s" in status["gpu"]["detail"]
    assert "not a GPU fault (not drained)" in status["gpu"]["detail"]
    assert status["gpu_xid"]["status"] == "error" and "Bad message" in status["gpu_xid"]["detail"]
    assert stops_starts(host) == []
    assert value(host.metrics(), "gpufleet_health_check_status", check="gpu", unit="",
                 status="error") == 1


def test_a_lost_state_file_after_a_drain_still_brings_the_engines_back(host, engine):
    """The drained list is read back from systemd where the state file is gone: the enabled
    engine units that are stopped are taken as drained and started once the host is healthy
    (a disabled one is not the checker's to start)."""
    drain_host(host, engine, fabric_ok=False, after_runs=1, return_after_runs=1, cooldown_s=0)
    host.run()
    assert stops_starts(host) == ["stop"]
    host.state.unlink()
    drain_host(host, engine, fabric_ok=True, after_runs=1, return_after_runs=1, cooldown_s=0)
    proc = host.run("--json")
    assert "the state file was lost: taking the enabled, stopped engines as drained: " \
        + DECODE in proc.stderr
    assert stops_starts(host) == ["stop", "start"]
    units = json.loads(host.units_file.read_text())
    assert units[DECODE]["state"] == "active"
    # an engine the operator disabled and stopped stays stopped
    units[DECODE].update(state="inactive", enabled=False)
    host.set_units(units)
    host.state.unlink()
    host.run()
    assert stops_starts(host) == ["stop", "start"]


def test_the_checker_keeps_its_hands_off_while_a_deploy_holds_the_host(host, engine):
    """A deploy's host lock (gpufleet_host_lock, unexpired): no restart and no drain, said
    in the log and the JSON; the failures still count, so a unit still failing once the
    deploy ends is restarted then. An expired lock (a deploy that died) is ignored."""
    lock = host.root / "deploy.lock"

    def configure(fabric_ok):
        drain_host(host, engine, fabric_ok=fabric_ok, after_runs=1)
        cfg = json.loads(host.config.read_text().split("\n", 1)[1])
        cfg.update(deploy_lock=str(lock), restart={"after_failures": 1, "cooldown_s": 0})
        host.config.write_text(json.dumps(cfg))

    def deploying(seconds_left):
        lock.write_text(json.dumps({"holder": "alice@ctl1", "started": time.time(),
                                    "expires": time.time() + seconds_left}))

    configure(fabric_ok=True)
    engine.mode = "error"
    deploying(600)
    proc = host.run("--json")
    assert json.loads(proc.stdout)["deploying"] == "alice@ctl1", proc.stderr
    assert "alice@ctl1 is deploying to this host" in proc.stderr
    assert host.restarts() == []
    deploying(-1)  # ended long ago without releasing it: ignored
    assert json.loads(host.run("--json").stdout)["deploying"] is None
    assert {c[-1] for c in host.restarts()} == {UNIT, DECODE}  # both fail health
    engine.mode = "ok"
    configure(fabric_ok=False)  # a host fault: no drain while deploying either
    deploying(600)
    assert json.loads(host.run("--json").stdout)["drained"] == []
    assert stops_starts(host) == []
    lock.unlink()
    assert json.loads(host.run("--json").stdout)["drained"] == [DECODE]


def test_a_run_that_holds_the_lock_too_long_makes_the_next_observe_only(host, engine):
    """A stuck run holds the state lock: the next waits lock_wait_s, then observes only
    (no restart, no drain, state unchanged) and says which lock and what to do."""
    import fcntl

    drain_host(host, engine, fabric_ok=False, after_runs=1)
    cfg = json.loads(host.config.read_text().split("\n", 1)[1])
    cfg["lock_wait_s"] = 0.5
    host.config.write_text(json.dumps(cfg))
    with open(str(host.state) + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        proc = host.run("--json")
        took = time.monotonic() - started
    report = json.loads(proc.stdout)
    state = {c["check"]: c for c in report["checks"]}["state"]
    assert state["status"] == "error" and "held" in state["detail"] and "observes only" in \
        state["detail"] and "gpufleet-health-watch" in state["detail"]
    assert report["host_fault"] == ["gpu_fabric"] and stops_starts(host) == []
    assert not host.state.exists() and took < 20
    assert host.run().returncode == 1 and stops_starts(host) == ["stop"]  # released: acts


def test_cache_filesystem_full(host, engine):
    host.write_config(engine, cache={"path": str(host.cache), "min_free_gib": 10**9})
    proc = host.run()
    assert proc.returncode == 1 and re.search(r"^FAIL cache .*minimum 1000000000 GiB",
                                              proc.stdout, re.M)
    host.write_config(engine, cache={"path": str(host.root / "missing"), "min_free_gib": 1})
    assert host.run().returncode == 1


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c["units"][0].pop("unit"), "units[0].unit: required"),
    (lambda c: c["units"][0].update(generate_url="localhost:8000"), "units[0].generate_url"),
    (lambda c: c["units"][0].update(served_name=None), "units[0].served_name"),
    (lambda c: c["units"][0].update(generate_timeout_s="30"), "units[0].generate_timeout_s"),
    (lambda c: c["units"][0].update(api_key_file="api-key"), "units[0].api_key_file"),
    (lambda c: c["units"][0].update(depends_on=["nope.service"]), "units[0].depends_on"),
    (lambda c: c["restart"].update(after_failures=0), "restart.after_failures"),
    (lambda c: c["restart"].update(enabled="yes"), "restart.enabled"),
    (lambda c: c["cache"].pop("path"), "cache.path: required"),
    (lambda c: c["gpu"].update(vendor="intel"), "gpu.vendor"),
    (lambda c: c["gpu"].update(temperature_max_c=0), "gpu.temperature_max_c"),
    (lambda c: c.update(version=2), "version"),
    (lambda c: c.update(textfile="metrics.prom"), "textfile"),
    (lambda c: c.update(gateway="gpufleet_gateway"),
     'gateway: expected an object like {"log_tag": "gpufleet_gateway"} or null'),
    (lambda c: c.update(gateway={}), "gateway.log_tag: required"),
    (lambda c: c.update(gateway={"log_tag": 7}), "gateway.log_tag: expected a syslog identifier"),
    (lambda c: c.update(gateway={"log_tag": "-k"}),
     "gateway.log_tag: expected a syslog identifier like gpufleet_gateway, got '-k'"),
    (lambda c: c.update(gateway={"log_tag": "gpufleet gateway"}), "gateway.log_tag"),
])
def test_config_errors_name_the_field(host, engine, mutate, field):
    cfg = host.write_config(engine)
    mutate(cfg)
    host.config.write_text(json.dumps(cfg))
    proc = host.run()
    assert proc.returncode == 2, proc.stdout
    assert f"config error: {field}" in proc.stdout
    assert not host.textfile.exists() and not host.state.exists()


def test_config_unreadable_or_not_json(host):
    proc = host.run()
    assert proc.returncode == 2 and "cannot read" in proc.stdout
    host.config.write_text("{units: []}")
    proc = host.run("--json")
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr
    assert json.loads(proc.stdout)["exit_code"] == 2


# ------------------------------------------------------------------------ real stand-in


def _standins():
    spec = importlib.util.spec_from_file_location("standins", REPO / "tests" / "unit" /
                                                  "test_standins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_real_standin_vllm(host, tmp_path):
    st = _standins()
    venv = st.make_venv(tmp_path / "standins")
    port = st.free_port()
    env = st.lab_env(tmp_path, venv)
    log = tmp_path / "vllm.log"
    cmd = (f"vllm serve {MODEL} --port {port} --host 127.0.0.1 --tensor-parallel-size 4 "
           f"--served-model-name {MODEL} --api-key {KEY}")
    server = st.Server(cmd, env, venv, log, port)
    try:
        server.wait()
        host.write_config(units=[unit_cfg(server.url, host.key_file, generate_timeout_s=5,
                                          health_timeout_s=3)])
        proc = host.run()
        assert proc.returncode == 0, proc.stdout + proc.stderr + log.read_text()
        assert value(host.metrics(), "gpufleet_health_check_ok", check="generate",
                     unit=UNIT) == 1
        assert_no_secret(host, proc)
        # the engine stops answering: health and generation fail, quickly
        host.write_config(units=[unit_cfg(server.url, host.key_file, generate_timeout_s=1,
                                          health_timeout_s=1)])
        server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            proc = host.run()
            assert proc.returncode == 1 and time.monotonic() - started < 5
            assert re.search(r"^FAIL generate .*timed out", proc.stdout, re.M)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        # a wrong key: 401 from the real API, the right key never printed
        host.key_file.write_text("sk-wrong\n")
        proc = host.run()
        assert proc.returncode == 1 and "401" in proc.stdout
        assert_no_secret(host, proc)
    finally:
        server.stop()


def is_stdlib(name: str) -> bool:
    """Found in this interpreter's standard library (sys.stdlib_module_names is 3.10+)."""
    if name in sys.builtin_module_names:
        return True
    spec = importlib.util.find_spec(name)
    paths = sysconfig.get_paths()
    origin = (spec.origin or "") if spec else ""
    return origin in ("built-in", "frozen") or "site-packages" not in origin and \
        origin.startswith((paths["stdlib"], paths["platstdlib"]))


def test_checker_is_stdlib_only():
    text = (REPO / "gpufleet" / "host" / "healthcheck.py").read_text()
    imports = {i.split(".")[0] for i in re.findall(r"^\s*(?:import|from) ([\w.]+)", text, re.M)}
    assert {"json", "urllib", "__future__"} <= {i for i in imports if is_stdlib(i)}
    assert not is_stdlib("pytest")
    assert {i for i in imports if not is_stdlib(i)} == {"gpu_facts", "gpufleet"}
    assert os.path.exists(REPO / "gpufleet" / "module_utils" / "gpu_facts.py")

#!/usr/bin/env python3
"""gpufleet health checker: one run per systemd timer tick, on every serving host.

Stdlib only, Python 3.8+. The health role installs this file (and gpu_facts.py next
to it) under /usr/local/lib/gpufleet/ and runs it from gpufleet-health.timer.

    healthcheck.py [--config /etc/gpufleet/health.json] [--json] [--no-restart]

Checks, per local unit: the unit is active, its HTTP health endpoint answers 200 and a
real one-token generation answers within its timeout (vLLM /health can answer 200 while
the engine core is wedged). Per host: GPU health from the driver (ECC, pending page
retirement or row remapping, fatal Xid events in the kernel log), free space on the
cache filesystem. Writes Prometheus textfile metrics atomically (temp file in the same
directory, then rename), logs one line per check (stdout, or stderr with --json) and
exits 0 healthy, 1 unhealthy, 2 config error. Every configured check gives a result on
every run (ok, fail, na or error); a check that raises is an error, and unhealthy.
After N consecutive failures of a unit past its start-up window it runs
`systemctl restart --no-block UNIT`, at most once per cooldown. --no-restart observes
only: no restart, the state file is left alone.

The config is JSON (leading '#' lines are comments); see roles/health/README.md.
Secrets: an API key is read from a file and sent in a header; it never appears in argv,
output, metrics or the state file.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.exists(os.path.join(HERE, "gpu_facts.py")):  # installed: gpu_facts.py next to it
    sys.path.insert(0, HERE)
    import gpu_facts
else:  # running from the repository
    from gpufleet.module_utils import gpu_facts

DEFAULT_CONFIG = "/etc/gpufleet/health.json"
DEFAULT_TEXTFILE = "/var/lib/node_exporter/textfile_collector/gpufleet.prom"
DEFAULT_STATE = "/var/lib/gpufleet/health-state.json"
# Xid codes that mean the GPU needs attention (reset, RMA), not an application fault:
# DBE, microcontroller halt, row-remap failure, NVLink, fallen off the bus, uncontained
# ECC, GSP timeout/error, unrecovered ECC, reset required.
DEFAULT_XID_FATAL = [48, 61, 62, 64, 74, 79, 95, 119, 120, 140, 154]
XID_RE = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
# error: the check raised (a bug or an environment the checker did not expect); unhealthy
# like fail, but never counted towards a restart (the unit may be fine)
OK, FAIL, NA, ERROR = "ok", "fail", "na", "error"
STATUSES = (OK, FAIL, NA, ERROR)


class ConfigError(Exception):
    pass


# ------------------------------------------------------------------------------ config


def _field(obj, key, where, kinds, default=ConfigError, check=None, hint=""):
    """obj[key] checked against kinds (tuple of types); ConfigError names the field."""
    name = f"{where}.{key}" if where else key
    if key not in obj or obj[key] is None:
        if default is ConfigError:
            raise ConfigError(f"{name}: required")
        return default
    value = obj[key]
    wrong_bool = isinstance(value, bool) and bool not in kinds
    if wrong_bool or not isinstance(value, kinds) or (check is not None and not check(value)):
        raise ConfigError(f"{name}: expected {hint or kinds[0].__name__}, got {value!r}")
    return value


def _url(value):
    parts = urllib.parse.urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def _positive(value):
    return value > 0


NUM = (int, float)


def load_config(path):
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    lines = text.splitlines()
    while lines and lines[0].lstrip().startswith("#"):  # Ansible's managed header
        lines.pop(0)
    body = "\n".join(lines)
    try:
        raw = json.loads(body)
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top")
    return validate(raw)


def validate(raw):
    version = _field(raw, "version", "", (int,), 1)
    if version != 1:
        raise ConfigError(f"version: expected 1, got {version!r}")
    cfg = {
        "host": _field(raw, "host", "", (str,), socket.gethostname()),
        "textfile": _field(raw, "textfile", "", (str,), DEFAULT_TEXTFILE, os.path.isabs,
                           "an absolute path"),
        "state_file": _field(raw, "state_file", "", (str,), DEFAULT_STATE, os.path.isabs,
                             "an absolute path"),
    }
    restart = _field(raw, "restart", "", (dict,), {})
    cfg["restart"] = {
        "enabled": _field(restart, "enabled", "restart", (bool,), True),
        "after_failures": _field(restart, "after_failures", "restart", (int,), 3, _positive,
                                 "an integer >= 1"),
        "cooldown_s": _field(restart, "cooldown_s", "restart", NUM, 3600,
                             lambda v: v >= 0, "a number >= 0"),
    }
    units = _field(raw, "units", "", (list,), [])
    cfg["units"] = [_unit(entry, f"units[{i}]") for i, entry in enumerate(units)]
    names = [u["unit"] for u in cfg["units"]]
    for i, unit in enumerate(cfg["units"]):
        if names.count(unit["unit"]) > 1:
            raise ConfigError(f"units[{i}].unit: {unit['unit']} is listed twice")
        for dep in unit["depends_on"]:
            if dep not in names:
                raise ConfigError(f"units[{i}].depends_on: {dep} is not in units")
    cache = _field(raw, "cache", "", (dict,), None)
    cfg["cache"] = None if cache is None else {
        "path": _field(cache, "path", "cache", (str,), ConfigError, os.path.isabs,
                       "an absolute path"),
        "min_free_gib": _field(cache, "min_free_gib", "cache", NUM, 10, lambda v: v >= 0,
                               "a number >= 0"),
    }
    gpu = _field(raw, "gpu", "", (dict,), {})
    cfg["gpu"] = {
        "vendor": _field(gpu, "vendor", "gpu", (str,), None, lambda v: v in ("nvidia", "amd"),
                         "nvidia, amd or null"),
        "count": _field(gpu, "count", "gpu", (int,), None, lambda v: v >= 0,
                        "an integer >= 0 or null"),
        "timeout_s": _field(gpu, "timeout_s", "gpu", NUM, 30, _positive, "a number > 0"),
        "xid_window_min": _field(gpu, "xid_window_min", "gpu", (int,), 5, _positive,
                                 "an integer >= 1"),
        "xid_fatal": _field(gpu, "xid_fatal", "gpu", (list,), DEFAULT_XID_FATAL,
                            lambda v: all(isinstance(x, int) for x in v), "a list of integers"),
        # the NVLink fabric is managed outside this host (gpu_facts.fabric_manager_mode
        # external): its GPUs' fabric state stands in for a local nvidia-fabricmanager unit
        "fabric": _field(gpu, "fabric", "gpu", (bool,), False),
    }
    return cfg


def _unit(raw, where):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object, got {raw!r}")
    unit = {
        "unit": _field(raw, "unit", where, (str,), ConfigError,
                       lambda v: re.fullmatch(r"[\w@.:-]+\.(service|target)", v) is not None,
                       "a unit name like gpufleet-decode.service"),
        "name": _field(raw, "name", where, (str,), ""),
        "role": _field(raw, "role", where, (str,), ""),
        "health_url": _field(raw, "health_url", where, (str,), None, _url, "an http(s) URL"),
        "generate_url": _field(raw, "generate_url", where, (str,), None, _url,
                               "an http(s) URL"),
        "served_name": _field(raw, "served_name", where, (str,), None),
        "api_key_file": _field(raw, "api_key_file", where, (str,), None, os.path.isabs,
                               "an absolute path"),
        "health_timeout_s": _field(raw, "health_timeout_s", where, NUM, 5, _positive,
                                   "a number > 0"),
        "generate_timeout_s": _field(raw, "generate_timeout_s", where, NUM, 30, _positive,
                                     "a number > 0"),
        "startup_grace_s": _field(raw, "startup_grace_s", where, NUM, 600, lambda v: v >= 0,
                                  "a number >= 0"),
        "restart": _field(raw, "restart", where, (bool,), True),
        "depends_on": _field(raw, "depends_on", where, (list,), [],
                             lambda v: all(isinstance(x, str) for x in v), "a list of units"),
        # what the operator should do when this unit is not active (host services)
        "fix": _field(raw, "fix", where, (str,), ""),
    }
    unit["sglang"] = bool(unit["generate_url"]) and urllib.parse.urlsplit(
        unit["generate_url"]).path.rstrip("/").endswith("/health_generate")
    if unit["generate_url"] and not unit["sglang"] and not unit["served_name"]:
        raise ConfigError(f"{where}.served_name: required with an OpenAI generate_url")
    return unit


# ------------------------------------------------------------------------------ checks


def result(check, unit, status, detail, started, **extra):
    out = {"check": check, "unit": unit, "status": status, "detail": detail,
           "duration_s": round(time.monotonic() - started, 4)}
    out.update(extra)
    return out


def crashed(check, unit, exc, started):
    """The result of a check that raised: an error naming the exception, never a pass."""
    at = ""
    if exc.__traceback__ is not None:  # where it raised: the innermost frame
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        at = f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    detail = f"check raised {type(exc).__name__}: {first_line(str(exc))}{at}"
    return result(check, unit, ERROR, detail, started)


def guarded(check, unit, fn, *args):
    """fn(*args) -> result, or an error result for (check, unit) when fn raises."""
    started = time.monotonic()
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a check that raises is an error, not a pass
        return crashed(check, unit, exc, started)


def guarded_host(check, fn, cfg, empty):
    """A host check: fn(cfg) -> (result, extra), or (error result, empty) when it raises."""
    started = time.monotonic()
    try:
        return fn(cfg)
    except Exception as exc:  # noqa: BLE001
        return crashed(check, "", exc, started), empty


def run(argv, timeout):
    """(rc, stdout, stderr); rc None when the tool is missing or timed out."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout,
                              text=True, errors="replace")
    except FileNotFoundError:
        return None, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return None, "", f"{argv[0]}: timed out after {timeout}s"
    return proc.returncode, proc.stdout, proc.stderr


def first_line(text, limit=200):
    text = (text or "").strip().splitlines()
    return text[0][:limit] if text else ""


def unit_status(unit):
    """ActiveState, LoadState, age of the current activation (s), NRestarts."""
    props = "ActiveEnterTimestampMonotonic,ActiveState,LoadState,NRestarts"
    rc, out, err = run(["systemctl", "show", "-p", props, unit], 10)
    if rc != 0:
        return {"error": first_line(err) or f"systemctl show exited {rc}"}
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    entered = int(values.get("ActiveEnterTimestampMonotonic") or 0)
    age = time.monotonic() - entered / 1e6 if entered else None
    return {"active_state": values.get("ActiveState", "unknown"),
            "load_state": values.get("LoadState", "unknown"),
            "age_s": age, "nrestarts": int(values.get("NRestarts") or 0)}


def safe_unit_status(unit):
    """unit_status, or {"raised": detail} when it raises (the active check is then an error)."""
    try:
        return unit_status(unit)
    except Exception as exc:  # noqa: BLE001
        return {"raised": crashed("active", unit, exc, time.monotonic())["detail"]}


def read_key(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read().strip()


def http(url, timeout, body=None, key=None):
    """(status, parsed JSON or None, text) of a GET (body None) or JSON POST."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if key:
        headers["Authorization"] = "Bearer " + key
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, text = resp.status, resp.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read(2048).decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    return status, parsed, text


def describe(exc):
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def check_health(unit):
    started = time.monotonic()
    try:
        status, _, text = http(unit["health_url"], unit["health_timeout_s"])
    except Exception as exc:  # noqa: BLE001 - any transport error is a failed check
        return result("health", unit["unit"], FAIL, "{}: {}".format(unit["health_url"],
                      describe(exc)), started)
    if status != 200:
        return result("health", unit["unit"], FAIL, "{} answered {}: {}".format(
            unit["health_url"], status, first_line(text)), started)
    return result("health", unit["unit"], OK, "{} answered 200".format(unit["health_url"]), started)


def check_generate(unit):
    started = time.monotonic()
    url, timeout = unit["generate_url"], unit["generate_timeout_s"]
    key = None
    if unit["api_key_file"]:
        try:
            key = read_key(unit["api_key_file"])
        except OSError as exc:
            return result("generate", unit["unit"], FAIL, "API key file {}: {}".format(
                unit["api_key_file"], exc.strerror), started)
    body = None if unit["sglang"] else {
        "model": unit["served_name"], "prompt": "ping", "max_tokens": 1, "temperature": 0}
    try:
        status, parsed, text = http(url, timeout, body, key)
    except Exception as exc:  # noqa: BLE001
        detail = f"{url}: {describe(exc)} (timeout {timeout}s)"
        return result("generate", unit["unit"], FAIL, scrub(detail, key), started)
    latency = time.monotonic() - started
    if status != 200:
        detail = f"{url} answered {status}: {first_line(text)}"
        return result("generate", unit["unit"], FAIL, scrub(detail, key), started)
    if not unit["sglang"] and not (isinstance(parsed, dict) and parsed.get("choices")):
        detail = f"{url} answered 200 without choices: {first_line(text)}"
        return result("generate", unit["unit"], FAIL, scrub(detail, key), started)
    return result("generate", unit["unit"], OK, f"one token in {latency:.3f}s", started,
                  latency_s=round(latency, 4))


def scrub(text, key):
    return text.replace(key, "***") if key else text


def check_active(unit, status):
    started = time.monotonic()
    if "raised" in status:  # unit_status itself raised (see safe_unit_status)
        return result("active", unit["unit"], ERROR, status["raised"], started)
    if "error" in status:
        return result("active", unit["unit"], FAIL, status["error"], started)
    state = status["active_state"]
    detail = f"ActiveState={state}"
    if status["load_state"] != "loaded":
        detail += " LoadState={}".format(status["load_state"])
    if state != "active" and unit["fix"]:
        detail += ". Fix: " + unit["fix"]
    return result("active", unit["unit"], OK if state == "active" else FAIL, detail, started)


def unit_checks(unit):
    """The checks configured for one unit, in the order they run."""
    return ["active"] + (["health"] if unit["health_url"] else []) + (
        ["generate"] if unit["generate_url"] else [])


def check_unit(unit, status, out):
    """All checks of one unit; results appended to out as they finish. Each check gives a
    result even when it raises (status error)."""
    name = unit["unit"]
    out.append(guarded("active", name, check_active, unit, status))
    if unit["health_url"]:
        out.append(guarded("health", name, check_health, unit))
    if unit["generate_url"]:
        out.append(guarded("generate", name, check_generate, unit))


def check_gpu(cfg):
    """Driver view of the GPUs; returns (result, gpus for metrics)."""
    started = time.monotonic()
    vendor = cfg["vendor"]
    if vendor == "amd":
        return result("gpu", "", NA, "AMD GPU health is not checked by this version",
                      started), []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        if vendor == "nvidia":
            return result("gpu", "", FAIL, "nvidia-smi not found, but this host's plan uses "
                          "NVIDIA GPUs", started), []
        return result("gpu", "", NA, "nvidia-smi not found", started), []
    rc, out, err = run([smi, "-q", "-x"], cfg["timeout_s"])
    if rc != 0:
        why = first_line(err) or first_line(out) or f"exited {rc}"
        return result("gpu", "", FAIL, f"nvidia-smi -q -x: {why}", started), []
    try:
        facts = gpu_facts.parse_nvidia_smi_xml(out)
        root = ET.fromstring(out.strip())
    except ET.ParseError as exc:
        return result("gpu", "", FAIL, f"nvidia-smi -q -x: bad XML: {exc}", started), []
    problems, gpus = [], []
    for gpu, node in zip(facts["gpus"], root.findall("gpu")):
        ecc = gpu["ecc_errors"]
        item = {"index": gpu["index"], "uuid": gpu["uuid"] or "",
                "volatile": ecc["volatile"]["uncorrectable"],
                "aggregate": ecc["aggregate"]["uncorrectable"]}
        gpus.append(item)
        where = "GPU {}".format(gpu["index"])
        if item["volatile"]:
            problems.append(f"{where}: {item['volatile']} uncorrected ECC errors")
        if gpu["remapped_rows_pending"]:
            problems.append(f"{where}: row remapping pending (needs a GPU reset)")
        if gpu["remapped_rows_failure"]:
            problems.append(f"{where}: row remapping failed")
        if gpu_facts.to_bool(node.findtext("retired_pages/pending_retirement")):
            problems.append(f"{where}: page retirement pending (needs a GPU reset)")
    if cfg["count"] is not None and len(gpus) < cfg["count"]:
        problems.append(f"{len(gpus)} GPUs visible, {cfg['count']} expected")
    down = ["GPU {} {}/{}".format(g["index"], g["fabric"]["state"] or "N/A",
                                  g["fabric"]["status"] or "N/A")
            for g in facts["gpus"] if not gpu_facts.fabric_ok(g["fabric"])]
    if cfg.get("fabric") and down:
        problems.append("NVLink fabric not Completed/Success ({}); it is managed outside this "
                        "host. Fix: the hypervisor's fabric manager must bring it up (ask the "
                        "provider, or stop and start the VM)".format(", ".join(down)))
    if problems:
        return result("gpu", "", FAIL, "; ".join(problems), started), gpus
    fabric = ", NVLink fabric Completed/Success" if cfg.get("fabric") else ""
    return result("gpu", "", OK, f"{len(gpus)} GPUs, no uncorrected ECC errors, nothing pending"
                  + fabric, started), gpus


def check_xid(cfg):
    """Xid events in the kernel log of the last xid_window_min minutes."""
    started = time.monotonic()
    if shutil.which("journalctl") is None:
        return result("gpu_xid", "", NA, "journalctl not found", started), {}
    window = cfg["xid_window_min"]
    # filtered here rather than with -g: journalctl may be built without pattern support
    rc, out, err = run(["journalctl", "-k", "--since", f"-{window}min", "-o", "cat",
                        "--no-pager", "-q"], 20)
    if rc != 0:
        return result("gpu_xid", "", FAIL, "journalctl -k: %s" % (
            first_line(err) or f"exited {rc}"), started), {}
    counts = {}
    fatal = []
    for match in XID_RE.finditer(out):
        code = int(match.group(2))
        counts[code] = counts.get(code, 0) + 1
        if code in cfg["xid_fatal"]:
            fatal.append(f"Xid {code} on {match.group(1)}")
    if fatal:
        return result("gpu_xid", "", FAIL, "in the last {} min: {}".format(
            window, ", ".join(sorted(set(fatal)))), started), counts
    seen = ", ".join(f"Xid {c} x{n}" for c, n in sorted(counts.items())) or "none"
    return result("gpu_xid", "", OK, f"no fatal Xid in the last {window} min ({seen})",
                  started), counts


def check_cache(cfg):
    started = time.monotonic()
    path, need = cfg["path"], cfg["min_free_gib"]
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return result("cache", "", FAIL, f"{path}: {exc.strerror}", started), None
    free = st.f_bavail * st.f_frsize
    detail = f"{path}: {free / 2**30:.1f} GiB free (minimum {need} GiB)"
    return result("cache", "", OK if free >= need * 2**30 else FAIL, detail, started), free


# ------------------------------------------------------------------------------ state


def load_state(path, log):
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
        if not isinstance(state.get("units"), dict):
            raise ValueError("no units")
        return state
    except FileNotFoundError:
        return {"version": 1, "units": {}}
    except (OSError, ValueError, AttributeError) as exc:
        log(f"state file {path} unreadable ({exc}): starting from empty state")
        return {"version": 1, "units": {}}


def atomic_write(path, text, mode=0o644):
    """Write text to path so that readers see the old or the new file, never a part."""
    directory, base = os.path.split(path)
    prefix = "." + base + ".tmp."
    for stale in glob.glob(os.path.join(directory, glob.escape(prefix) + "*")):
        try:  # left by a run killed between write and rename
            if time.time() - os.stat(stale).st_mtime > 600:
                os.unlink(stale)
        except OSError:
            pass
    tmp = os.path.join(directory, prefix + str(os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def starting(unit, status):
    """True while systemd starts the unit or it has been up less than startup_grace_s."""
    active, age = status.get("active_state"), status.get("age_s")
    return active in ("activating", "reloading") or (
        active == "active" and age is not None and age < unit["startup_grace_s"])


def decide_restarts(cfg, statuses, failed, state, log, act, errored=()):
    """Advance failure streaks and restart units; returns {unit: decision text}. A unit
    whose checks only raised (errored) keeps its streak as it was: no evidence either way."""
    policy = cfg["restart"]
    now = time.time()
    decisions = {}
    for unit in cfg["units"]:
        name = unit["unit"]
        st = state["units"].setdefault(
            name, {"consecutive_failures": 0, "last_restart": None, "restarts": 0})
        status = statuses.get(name, {})
        active = status.get("active_state")
        age = status.get("age_s")
        if name in errored:
            decisions[name] = "not counted: a check raised (see ERROR above)"
            continue
        if name not in failed:
            st["consecutive_failures"] = 0
            continue
        if starting(unit, status):
            st["consecutive_failures"] = 0
            decisions[name] = "in start-up window ({}, up {}s, grace {}s): not counted".format(
                active, int(age or 0), unit["startup_grace_s"])
            continue
        deps = [d for d in unit["depends_on"] if d in failed]
        if deps:
            decisions[name] = "not counted: depends on unhealthy {}".format(", ".join(deps))
            continue
        st["consecutive_failures"] += 1
        count, need = st["consecutive_failures"], policy["after_failures"]
        if not (policy["enabled"] and unit["restart"]):
            decisions[name] = f"failure {count}, restarts disabled"
            continue
        if count < need:
            decisions[name] = f"failure {count} of {need} before a restart"
            continue
        if active in ("inactive", "deactivating", None):
            decisions[name] = "failure {}: {}, not restarting (stopped on purpose?)".format(
                count, active or "state unknown")
            continue
        since = None if st["last_restart"] is None else now - st["last_restart"]
        if since is not None and since < policy["cooldown_s"]:
            decisions[name] = "failure {}: restarted {:.0f}s ago, cooldown {}s".format(
                count, since, policy["cooldown_s"])
            continue
        if not act:
            decisions[name] = f"failure {count}: would restart (--no-restart)"
            continue
        rc, _, err = run(["systemctl", "restart", "--no-block", name], 30)
        if rc == 0:
            st.update(last_restart=now, restarts=st["restarts"] + 1, consecutive_failures=0)
            decisions[name] = f"restart requested after {count} consecutive failures"
        else:
            decisions[name] = "systemctl restart failed: %s" % (first_line(err) or rc)
        log(f"restart {name}: {decisions[name]}")
    return decisions


# ------------------------------------------------------------------------------ metrics


def escape(value):
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_metrics(families):
    """families: [(name, type, help, [(labels dict, value)])] -> exposition text."""
    lines = []
    for name, kind, text, samples in families:
        lines.append("# HELP {} {}".format(name, text.replace("\\", "\\\\").replace("\n", " ")))
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            body = ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items()))
            lines.append("{}{} {}".format(name, f"{{{body}}}" if body else "", number(value)))
    return "\n".join(lines) + "\n"


def metrics(cfg, results, statuses, state, gpus, xids, free, ran_at):
    checks = [r for r in results if r["status"] != NA]
    restarts = []
    for unit in cfg["units"]:
        name = unit["unit"]
        restarts.append(({"unit": name, "by": "healthcheck"},
                         state["units"].get(name, {}).get("restarts", 0)))
        if "nrestarts" in statuses.get(name, {}):
            restarts.append(({"unit": name, "by": "systemd"}, statuses[name]["nrestarts"]))
    families = [
        ("gpufleet_health_check_ok", "gauge",
         "1 when the check passed, 0 when it failed or raised (checks that do not apply are "
         "absent).",
         [({"check": r["check"], "unit": r["unit"]}, r["status"] == OK) for r in checks]),
        ("gpufleet_health_check_status", "gauge",
         "1 for the status every configured check had in this run, 0 for the others: ok, "
         "fail, na (does not apply here), error (the check raised; see the checker's log).",
         [({"check": r["check"], "unit": r["unit"], "status": s}, r["status"] == s)
          for r in results for s in STATUSES]),
        ("gpufleet_health_check_duration_seconds", "gauge", "Time the check took.",
         [({"check": r["check"], "unit": r["unit"]}, r["duration_s"]) for r in checks]),
        ("gpufleet_health_ok", "gauge",
         "1 when no check on this host failed or raised.",
         [({}, all(r["status"] in (OK, NA) for r in results))]),
        ("gpufleet_unit_consecutive_failures", "gauge",
         "Consecutive failed runs of the unit's checks, past its start-up window.",
         [({"unit": u["unit"]},
           state["units"].get(u["unit"], {}).get("consecutive_failures", 0))
          for u in cfg["units"]]),
        ("gpufleet_unit_in_startup_window", "gauge",
         "1 while the unit starts or is younger than its start-up grace period.",
         [({"unit": u["unit"]}, starting(u, statuses.get(u["unit"], {})))
          for u in cfg["units"]]),
        ("gpufleet_unit_restarts_total", "counter",
         "Restarts of the unit: by the health checker, and by systemd (NRestarts).", restarts),
        ("gpufleet_generation_latency_seconds", "gauge",
         "Latency of the last successful one-token generation.",
         [({"unit": r["unit"]}, r["latency_s"]) for r in results if "latency_s" in r]),
    ]
    if free is not None:
        families.append(("gpufleet_cache_free_bytes", "gauge",
                         "Free bytes for unprivileged users on the cache filesystem.",
                         [({"path": cfg["cache"]["path"]}, free)]))
    if gpus:
        samples = []
        for g in gpus:
            for counter in ("volatile", "aggregate"):
                if g[counter] is not None:
                    samples.append(({"gpu": g["index"], "uuid": g["uuid"],
                                     "counter": counter}, g[counter]))
        families.append(("gpufleet_gpu_ecc_uncorrected_errors", "gauge",
                         "Uncorrected ECC errors per GPU (volatile: since the driver "
                         "loaded; aggregate: lifetime).", samples))
    if xids is not None:
        families.append(("gpufleet_gpu_xid_events", "gauge",
                         "Xid events in the kernel log during the look-back window.",
                         [({"xid": code}, n) for code, n in sorted(xids.items())]))
    families.append(("gpufleet_health_last_run_timestamp_seconds", "gauge",
                     "Unix time the health checker last finished a run.", [({}, ran_at)]))
    return render_metrics(families)


# ------------------------------------------------------------------------------ main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-restart", action="store_true",
                        help="observe only: never restart, leave the state file alone")
    args = parser.parse_args(argv)
    logfile = sys.stderr if args.json else sys.stdout

    def log(line):
        print(line, file=logfile, flush=True)

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        log(f"config error: {exc}")
        if args.json:
            print(json.dumps({"healthy": False, "exit_code": 2, "error": str(exc)}))
        return 2

    started = time.monotonic()
    statuses = {u["unit"]: safe_unit_status(u["unit"]) for u in cfg["units"]}
    results = []
    host_out = {}
    # check name, function, its config, what the metrics get when it raises
    host_jobs = [("gpu", check_gpu, cfg["gpu"], []), ("gpu_xid", check_xid, cfg["gpu"], None)]
    if cfg["cache"]:
        host_jobs.append(("cache", check_cache, cfg["cache"], None))

    def host_checks():
        for check, fn, conf, empty in host_jobs:
            host_out[check] = guarded_host(check, fn, conf, empty)

    jobs = []
    for unit in cfg["units"]:
        out = []
        jobs.append((unit, out, threading.Thread(
            target=check_unit, args=(unit, statuses[unit["unit"]], out), daemon=True)))
    host_thread = threading.Thread(target=host_checks, daemon=True)
    for _, _, thread in jobs:
        thread.start()
    host_thread.start()
    budget = max([u["health_timeout_s"] + u["generate_timeout_s"] for u in cfg["units"]] +
                 [cfg["gpu"]["timeout_s"] + 20]) + 10
    deadline = started + budget

    def no_result(check, unit, thread):
        """Every configured check has a result: one still running past the budget fails,
        one whose thread ended without a result is an error."""
        if thread.is_alive():
            return result(check, unit, FAIL, f"did not finish within {budget}s", started)
        return result(check, unit, ERROR, "gave no result (its thread ended early)", started)

    for unit, out, thread in jobs:
        thread.join(max(0.0, deadline - time.monotonic()))
        got = list(out)
        done = {r["check"] for r in got}
        results.extend(got + [no_result(c, unit["unit"], thread) for c in unit_checks(unit)
                              if c not in done])
    host_thread.join(max(0.0, deadline - time.monotonic()))
    extras = {}
    for check, _, _, _ in host_jobs:
        if check in host_out:
            res, extras[check] = host_out[check]
            results.append(res)
        else:
            results.append(no_result(check, "", host_thread))
    gpus, xids, free = extras.get("gpu") or [], extras.get("gpu_xid"), extras.get("cache")

    for r in results:
        log("{:<4} {:<8} {} {:.3f}s {}".format(r["status"].upper(), r["check"], r["unit"] or "-",
                                              r["duration_s"], r["detail"]))

    failed = {r["unit"] for r in results if r["status"] == FAIL and r["unit"]}
    errored = {r["unit"] for r in results if r["status"] == ERROR and r["unit"]} - failed
    state_path = cfg["state_file"]
    decisions = {}
    if args.no_restart:
        state = load_state(state_path, log)
        scratch = json.loads(json.dumps(state))
        decisions = decide_restarts(cfg, statuses, failed, scratch, log, act=False,
                                    errored=errored)
    else:
        lock_path = state_path + ".lock"
        try:
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                state = load_state(state_path, log)
                decisions = decide_restarts(cfg, statuses, failed, state, log, act=True,
                                            errored=errored)
                state["updated"] = time.time()
                atomic_write(state_path, json.dumps(state, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            log(f"FAIL state   - state file {state_path}: {exc}")
            results.append(result("state", "", FAIL, f"{state_path}: {exc}", started))
            state = {"units": {}}
    for name, text in decisions.items():
        log(f"INFO restart  {name} {text}")

    healthy = all(r["status"] in (OK, NA) for r in results)
    try:
        atomic_write(cfg["textfile"], metrics(cfg, results, statuses, state, gpus, xids,
                                              free, time.time()))
    except OSError as exc:
        log("FAIL metrics - {}: {}".format(cfg["textfile"], exc))
        healthy = False
    code = 0 if healthy else 1
    log("{}: {} in {:.2f}s".format(cfg["host"], "healthy" if healthy else "UNHEALTHY",
                              time.monotonic() - started))
    if args.json:
        units = {}
        for unit in cfg["units"]:
            name = unit["unit"]
            status = statuses[name]
            units[name] = {
                "name": unit["name"], "role": unit["role"],
                "active_state": status.get("active_state"),
                "nrestarts": status.get("nrestarts"),
                "consecutive_failures": state["units"].get(name, {}).get(
                    "consecutive_failures", 0),
                "restart": decisions.get(name)}
        print(json.dumps({"host": cfg["host"], "healthy": healthy, "exit_code": code,
                          "timestamp": time.time(), "checks": results, "units": units},
                         indent=1, sort_keys=True))
    return code


if __name__ == "__main__":
    sys.exit(main())

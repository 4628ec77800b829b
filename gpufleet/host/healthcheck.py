#!/usr/bin/env python3
"""gpufleet health checker: one run per systemd timer tick, on every serving host.

Stdlib only, Python 3.8+. The health role installs this file (and gpu_facts.py next
to it) under /usr/local/lib/gpufleet/ and runs it from gpufleet-health.timer.

    healthcheck.py [--config /etc/gpufleet/health.json] [--json] [--no-restart]

Checks, per local unit: the unit is active, its HTTP health endpoint answers 200 and a
real one-token generation answers within its timeout (vLLM /health can answer 200 while
the engine core is wedged). Per host: GPU health from the driver (ECC, pending page
retirement or row remapping, fatal Xid events in the kernel log), free space on the
cache filesystem and, where configured, the API gateway's responses by status code (its
access log in the journal). Writes Prometheus textfile metrics atomically (temp file in
the same directory, then rename), logs one line per check (stdout, or stderr with --json)
and exits 0 healthy, 1 unhealthy, 2 config error. Every configured check gives a result on
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
import ctypes
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
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
# where Debian's and Ubuntu's prometheus-node-exporter read textfiles
DEFAULT_TEXTFILE = "/var/lib/prometheus/node-exporter/gpufleet.prom"
DEFAULT_STATE = "/var/lib/gpufleet/health-state.json"
# written by a deploy while it changes this host's units (gpufleet_host_lock)
DEFAULT_DEPLOY_LOCK = "/run/gpufleet/deploy.lock"
# NVLink error counters (nvidia-smi nvlink -e): a recovery is a link retrain, always worth a
# look; replays and CRC errors happen at low rates on healthy links
DEFAULT_NVLINK_DELTA = {"recovery": 0, "replay": 100, "crc": 100, "default": 100}
# InfiniBand/RoCE port counters (sysfs ports/N/counters): a link that went down or
# retrained is always reported; bit errors at low rates are normal
IB_COUNTERS = ("link_downed", "link_error_recovery", "symbol_error", "port_rcv_errors",
               "local_link_integrity_errors", "excessive_buffer_overrun_errors")
DEFAULT_IB_DELTA = {"link_downed": 0, "link_error_recovery": 0, "default": 100}
# Xid codes that mean the GPU needs attention (reset, RMA), not an application fault:
# DBE, microcontroller halt, row-remap failure, NVLink, fallen off the bus, uncontained
# ECC, GSP timeout/error, unrecovered ECC, reset required.
DEFAULT_XID_FATAL = [48, 61, 62, 64, 74, 79, 95, 119, 120, 140, 154]
XID_RE = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
# One line of the API gateway's access log (nginx log_format gpufleet in
# roles/serve/templates/gateway-nginx.conf.j2): `$remote_addr "$request" $status
# $body_bytes_sent $request_time`. The request line may hold quotes and spaces, so the
# status is read from the end: the three fields after the last quote.
GATEWAY_LINE_RE = re.compile(r'\S+ ".*" (\d{3}) (\d+) (\d+(?:\.\d+)?)')
# how long one run reads the gateway's log; what is left is read by the next run
GATEWAY_READ_S = 20
# error: the check raised (a bug or an environment the checker did not expect); unhealthy
# like fail, but never counted towards a restart (the unit may be fine)
OK, FAIL, NA, ERROR = "ok", "fail", "na", "error"
TIMED_OUT = "timed out"
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
COUNTER_LIMITS = "an object of counter: integer >= 0"


def _counter_limits(value):
    return all(isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
               for k, n in value.items())


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
        # lifetime uncorrected ECC errors a GPU may have before it is flagged for RMA
        "ecc_aggregate_max": _field(gpu, "ecc_aggregate_max", "gpu", (int,), 10,
                                    lambda v: v >= 0, "an integer >= 0"),
        # AMD: the hotspot (junction) temperature a GPU may reach before gpu_thermal fails
        "temperature_max_c": _field(gpu, "temperature_max_c", "gpu", NUM, 100, _positive,
                                    "a number > 0"),
        # how much an NVLink error counter may rise between two runs (default: any other)
        "nvlink_error_delta_max": dict(DEFAULT_NVLINK_DELTA, **_field(
            gpu, "nvlink_error_delta_max", "gpu", (dict,), {}, _counter_limits,
            COUNTER_LIMITS)),
        "xid_fatal": _field(gpu, "xid_fatal", "gpu", (list,), DEFAULT_XID_FATAL,
                            lambda v: all(isinstance(x, int) for x in v), "a list of integers"),
        # the NVLink fabric is managed outside this host (gpu_facts.fabric_manager_mode
        # external): its GPUs' fabric state stands in for a local nvidia-fabricmanager unit
        "fabric": _field(gpu, "fabric", "gpu", (bool,), False),
    }
    ib = _field(raw, "ib", "", (dict,), None)
    cfg["ib"] = None if ib is None else {
        "sysfs": _field(ib, "sysfs", "ib", (str,), "/sys/class/infiniband", os.path.isabs,
                        "an absolute path"),
        # the HCAs the plan moves data over; empty: every HCA the host has
        "devices": _field(ib, "devices", "ib", (list,), [], lambda v: all(
            isinstance(x, str) for x in v), "a list of HCA names"),
        "min_rate_gbps": _field(ib, "min_rate_gbps", "ib", NUM, None, _positive,
                                "a number > 0 or null"),
        "error_delta_max": dict(DEFAULT_IB_DELTA, **_field(
            ib, "error_delta_max", "ib", (dict,), {}, _counter_limits, COUNTER_LIMITS)),
    }
    # the API gateway on this host: its access log (journal entries with SYSLOG_IDENTIFIER
    # log_tag) counted by status code; absent or null: not read
    gateway = _field(raw, "gateway", "", (dict,), None, hint='an object like {"log_tag": '
                     '"gpufleet_gateway"} or null')
    cfg["gateway"] = None if gateway is None else {
        "log_tag": _field(gateway, "log_tag", "gateway", (str,), ConfigError,
                          lambda v: re.fullmatch(r"[A-Za-z0-9_.@][A-Za-z0-9_.@-]*", v)
                          is not None, "a syslog identifier like gpufleet_gateway"),
    }
    # a sick host's engines are stopped until its host checks pass again (drain): after
    # after_runs runs in a row that find a host fault, back after return_after_runs runs in
    # a row that find none, never the other way within cooldown_s of a change (a flapping
    # fault costs one stop and one start per cooldown, not one per run). `drain: false`
    # only holds restarts.
    drain = _field(raw, "drain", "", (bool, dict), True)
    drain = {"enabled": drain} if isinstance(drain, bool) else drain
    cfg["drain"] = {
        "enabled": _field(drain, "enabled", "drain", (bool,), True),
        "after_runs": _field(drain, "after_runs", "drain", (int,), 2, _positive,
                             "an integer >= 1"),
        "return_after_runs": _field(drain, "return_after_runs", "drain", (int,), 3,
                                    _positive, "an integer >= 1"),
        "cooldown_s": _field(drain, "cooldown_s", "drain", NUM, 600, lambda v: v >= 0,
                             "a number >= 0"),
    }
    # while a deploy holds this lock (unexpired), no run restarts or drains anything
    cfg["deploy_lock"] = _field(raw, "deploy_lock", "", (str,), DEFAULT_DEPLOY_LOCK,
                                os.path.isabs, "an absolute path")
    # how long a run waits for the state lock a running (or stuck) one holds; default: a
    # run's own time budget
    cfg["lock_wait_s"] = _field(raw, "lock_wait_s", "", NUM, None, lambda v: v >= 0,
                                "a number >= 0 or null")
    watch = _field(raw, "watch", "", (dict,), {})
    cfg["watch"] = {
        # how often the resident watcher (--watch) polls NVML or nvidia-smi and sysfs
        "interval_s": _field(watch, "interval_s", "watch", NUM, 2, _positive, "a number > 0"),
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
        # an https health_url's CA file (PEM); None: the system's trust store
        "ca_file": _field(raw, "ca_file", where, (str,), None, os.path.isabs,
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
        # the unit runs an engine on the GPUs: a sick host's drain stops it
        "drain": _field(raw, "drain", where, (bool,), False),
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
    """(rc, stdout, stderr); rc None when the tool is missing or timed out (TIMED_OUT in
    stderr: the checker's own trouble, never a host fault)."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout,
                              text=True, errors="replace")
    except FileNotFoundError:
        return None, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return None, "", f"{argv[0]}: {TIMED_OUT} after {timeout}s"
    return proc.returncode, proc.stdout, proc.stderr


def first_line(text, limit=200):
    text = (text or "").strip().splitlines()
    return text[0][:limit] if text else ""


def unit_status(unit):
    """ActiveState, LoadState, UnitFileState, age of the current activation (s), NRestarts."""
    props = "ActiveEnterTimestampMonotonic,ActiveState,LoadState,NRestarts,UnitFileState"
    rc, out, err = run(["systemctl", "show", "-p", props, unit], 10)
    if rc != 0:
        return {"error": first_line(err) or f"systemctl show exited {rc}"}
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    entered = int(values.get("ActiveEnterTimestampMonotonic") or 0)
    age = time.monotonic() - entered / 1e6 if entered else None
    return {"active_state": values.get("ActiveState", "unknown"),
            "load_state": values.get("LoadState", "unknown"),
            "enabled": values.get("UnitFileState") == "enabled",
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


def http(url, timeout, body=None, key=None, ca_file=None):
    """(status, parsed JSON or None, text) of a GET (body None) or JSON POST; an https URL
    verified with CA_FILE (else the system's trust store)."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if key:
        headers["Authorization"] = "Bearer " + key
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") \
            else None
        with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
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
        status, _, text = http(unit["health_url"], unit["health_timeout_s"],
                               ca_file=unit["ca_file"])
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


def gpu_name(gpu):
    """How a failure names a GPU: index, UUID and PCI address."""
    return "GPU {} ({}, {})".format(gpu["index"], gpu["uuid"] or "uuid unknown",
                                    gpu["bus_id"] or "PCI address unknown")


def pci_key(address):
    """A GPU's PCI address as the kernel log names it: 00000000:18:00.0 and PCI:0000:18:00
    both give 0000:18:00."""
    address = (address or "").lower().replace("pci:", "")
    parts = address.split(".")[0].split(":")
    if len(parts) != 3:
        return address
    return "{}:{}:{}".format(parts[0][-4:].rjust(4, "0"), parts[1].rjust(2, "0"),
                             parts[2].rjust(2, "0"))


def verdict(check, problems, ok_detail, started):
    if problems:
        return result(check, "", FAIL, "; ".join(problems), started)
    return result(check, "", OK, ok_detail, started)


def gpu_ecc(cfg, gpus, started):
    limit = cfg["ecc_aggregate_max"]
    problems = []
    for gpu in gpus:
        ecc = gpu["ecc_errors"]
        volatile, aggregate = ecc["volatile"]["uncorrectable"], ecc["aggregate"]["uncorrectable"]
        if volatile:
            problems.append(f"{gpu_name(gpu)}: {volatile} uncorrected ECC errors since the "
                            "driver loaded. Action: drain the host and reset the GPU "
                            f"(nvidia-smi -r -i {gpu['index']}); replace it if they come back")
        elif aggregate is not None and aggregate > limit:
            problems.append(f"{gpu_name(gpu)}: {aggregate} uncorrected ECC errors in its "
                            f"lifetime (more than {limit}). Action: replace the GPU (RMA)")
    return verdict("gpu_ecc", problems, "no uncorrected ECC errors (lifetime at most "
                   f"{limit})", started)


def gpu_remap(gpus, started):
    problems = []
    for gpu in gpus:
        if gpu["remapped_rows_failure"]:
            problems.append(f"{gpu_name(gpu)}: row remapping failed. Action: replace the GPU "
                            "(RMA)")
        elif gpu["remapped_rows_pending"] or gpu["retirement_pending"]:
            what = "row remapping" if gpu["remapped_rows_pending"] else "page retirement"
            problems.append(f"{gpu_name(gpu)}: {what} pending. Action: drain the host and "
                            f"reset the GPU (nvidia-smi -r -i {gpu['index']}) or reboot")
    return verdict("gpu_remap", problems, "no row remapping or page retirement pending",
                   started)


def gpu_pcie(gpus, started):
    problems, idle = [], []
    for gpu in gpus:
        link = gpu["pcie"]
        if None not in (link["width_current"], link["width_max"]) and \
                link["width_current"] < link["width_max"]:
            problems.append("{}: PCIe link x{} of x{}. Action: reseat the GPU or its riser "
                            "and check the slot; a reboot retrains the link".format(
                                gpu_name(gpu), link["width_current"], link["width_max"]))
        if None not in (link["gen_current"], link["gen_max"]) and \
                link["gen_current"] < link["gen_max"]:
            if gpu["clock_events"].get("gpu_idle"):
                idle.append(gpu["index"])  # an idle GPU may lower its link speed to save power
            else:
                problems.append("{}: PCIe gen {} of {} while busy. Action: check the slot "
                                "and riser, then reboot to retrain the link".format(
                                    gpu_name(gpu), link["gen_current"], link["gen_max"]))
    note = f" (idle GPUs {idle} below their maximum gen: power saving)" if idle else ""
    return verdict("gpu_pcie", problems, "PCIe links at their maximum width" + note, started)


CLOCK_FAULTS = {
    "hw_slowdown": "hardware slowdown (over temperature or a power brake). Action: check the "
                   "GPU's cooling and the power supply (BMC event log)",
    "hw_thermal_slowdown": "hardware thermal slowdown. Action: check the GPU's cooling (fans, "
                           "air flow, inlet temperature)",
    "hw_power_brake_slowdown": "power brake slowdown (asserted by the system: PSU or BMC). "
                               "Action: check the power supplies and the BMC event log",
    "sw_thermal_slowdown": "software thermal slowdown (above its maximum operating "
                           "temperature). Action: check the GPU's cooling",
}


def gpu_clocks(gpus, started):
    problems = []
    for gpu in gpus:
        for reason, what in CLOCK_FAULTS.items():
            if gpu["clock_events"].get(reason):
                problems.append(f"{gpu_name(gpu)}: {what}")
    return verdict("gpu_clocks", problems, "no hardware, thermal or power-brake slowdown",
                   started)


def gpu_fabric(cfg, gpus, started):
    states = [g for g in gpus if g["fabric"]["state"]]
    if not states and not cfg["fabric"]:
        return result("gpu_fabric", "", NA, "the GPUs are not on an NVSwitch fabric", started)
    if cfg["fabric"]:
        fix = ("the fabric is managed outside this host: the hypervisor's fabric manager must "
               "bring it up (ask the provider, or stop and start the VM)")
    else:
        fix = ("check nvidia-fabricmanager (systemctl status nvidia-fabricmanager; its journal "
               "names the NVSwitch or GPU it could not train), then reset the GPUs or reboot")
    down = ["{}: fabric {}/{}".format(gpu_name(g), g["fabric"]["state"] or "N/A",
                                      g["fabric"]["status"] or "N/A")
            for g in gpus if not gpu_facts.fabric_ok(g["fabric"])]
    if down:
        return result("gpu_fabric", "", FAIL, "{}. Action: {}".format("; ".join(down), fix),
                      started)
    return result("gpu_fabric", "", OK, f"{len(gpus)} GPUs: NVLink fabric Completed/Success",
                  started)


def counter_rises(before, now, limits):
    """[(counter, rise, limit)] of the error counters that rose by more than their limit
    (limits["default"] for the others) since the last run. A counter seen for the first
    time is the baseline; one lower than before was reset (driver reload, GPU reset), so
    its whole value is the rise."""
    out = []
    for counter, value in sorted(now.items()):
        last = before.get(counter)
        if last is None:
            continue
        rise = value if value < last else value - last
        limit = limits.get(counter, limits["default"])
        if rise > limit:
            out.append((counter, rise, limit))
    return out


def gpu_nvlink(cfg, gpus, state, started):
    """NVLink state (nvidia-smi nvlink -s) and error counters' rise since the last run
    (nvidia-smi nvlink -e); returns (result, links by GPU index, errors by GPU index)."""
    timeout = cfg["timeout_s"]
    rc, out, err = run(["nvidia-smi", "nvlink", "-s"], timeout)
    if rc != 0:
        why = first_line(err) or first_line(out) or f"exited {rc}"
        return result("gpu_nvlink", "", FAIL, f"nvidia-smi nvlink -s: {why}", started), {}, {}
    links = {g["index"]: g["links"] for g in gpu_facts.parse_nvlink_status(out) if g["links"]}
    if not links:
        return result("gpu_nvlink", "", NA, "no NVLink on these GPUs", started), {}, {}
    by_index = {g["index"]: g for g in gpus}
    problems = []
    for index, items in sorted(links.items()):
        down = [str(link["link"]) for link in items if not link["active"]]
        if down:
            name = gpu_name(by_index[index]) if index in by_index else f"GPU {index}"
            problems.append("{}: NVLink {} inactive ({} of {} active). Action: reset the GPU "
                            "(nvidia-smi -r -i {}) or reboot; if it stays down, the NVLink "
                            "or baseboard needs service".format(
                                name, ", ".join(down), len(items) - len(down), len(items),
                                index))
    rc, out, err = run(["nvidia-smi", "nvlink", "-e"], timeout)
    if rc != 0:
        why = first_line(err) or first_line(out) or f"exited {rc}"
        problems.append(f"nvidia-smi nvlink -e: {why}")
        errors = {}
    else:
        errors = gpu_facts.parse_nvlink_errors(out)
    before = state.get("nvlink_errors", {})
    now = {}
    limits = cfg["nvlink_error_delta_max"]
    for index, counters in sorted(errors.items()):
        gpu = by_index.get(index)
        key = gpu["uuid"] if gpu and gpu["uuid"] else str(index)
        now[key] = counters
        for counter, rise, limit in counter_rises(before.get(key, {}), counters, limits):
            problems.append("{}: NVLink {} errors rose by {} since the last run (more than "
                            "{}). Action: the link is degrading: drain the host and have "
                            "the NVLink checked".format(
                                gpu_name(gpu) if gpu else f"GPU {index}", counter, rise, limit))
    state["nvlink_errors"] = now
    total = sum(len(items) for items in links.values())
    return verdict("gpu_nvlink", problems, f"{total} NVLink links active on {len(links)} GPUs, "
                   "error counters steady", started), links, errors


def gpu_count(cfg, gpus, label, started):
    """The gpu check: as many GPUs as the plan has; the detail lists each as label says."""
    problems = []
    if cfg["count"] is not None and len(gpus) < cfg["count"]:
        problems.append("{} GPUs visible, {} expected. Action: a GPU fell off the bus or "
                        "failed to initialize: reboot the host; reseat or replace it if it "
                        "stays missing".format(len(gpus), cfg["count"]))
    return verdict("gpu", problems, "{} GPUs: {}".format(len(gpus), ", ".join(
        label.format(**g) for g in gpus)) if gpus else "0 GPUs", started)


def gpu_only(checks, status, detail, rest, started):
    """The gpu check's result; the vendor's other checks do not apply without its data."""
    return [result("gpu", "", status, detail, started)] + [
        result(c, "", NA, rest or detail, started) for c in checks[1:]]


def nvidia_smi_gpus(timeout):
    """(the GPUs of `nvidia-smi -q -x`, None), or (None, why it gave none)."""
    rc, out, err = run(["nvidia-smi", "-q", "-x"], timeout)
    if rc == 0:
        try:
            return gpu_facts.parse_nvidia_smi_xml(out)["gpus"], None
        except ET.ParseError as exc:
            rc, err = 1, f"bad XML: {exc}"
    return None, first_line(err) or first_line(out) or f"exited {rc}"


def check_nvidia(cfg, state):
    """The NVIDIA GPU checks from one `nvidia-smi -q -x` (and `nvlink -s/-e`); returns
    (results, per-GPU data for the metrics and the Xid check)."""
    started = time.monotonic()
    data = {"gpus": [], "links": {}, "nvlink_errors": {}}
    vendor = cfg["vendor"]

    def only(check_status, detail, rest=None):
        return gpu_only(GPU_CHECKS, check_status, detail, rest, started), data

    if shutil.which("nvidia-smi") is None:
        if vendor == "nvidia":
            return only(FAIL, "nvidia-smi not found, but this host's plan uses NVIDIA GPUs. "
                        "Action: install the NVIDIA driver (the nvidia_driver role)",
                        rest="no data: nvidia-smi not found (see the gpu check)")
        return only(NA, "nvidia-smi not found")
    gpus, why = nvidia_smi_gpus(cfg["timeout_s"])
    if why and TIMED_OUT in why:  # slow, not broken: its own alert, the host is not drained
        return only(ERROR, f"nvidia-smi -q -x: {why}: the checker's tool is slow, not a GPU "
                    "fault (not drained). Action: raise health_gpu_timeout_s if it stays "
                    "slow; check the driver (dmesg) if it does not answer at all",
                    rest="no data: nvidia-smi timed out (see the gpu check)")
    if why:
        return only(FAIL, f"nvidia-smi -q -x: {why}. Action: check the driver (dmesg), reboot "
                    "if it does not answer", rest="no data: nvidia-smi failed (see the gpu "
                    "check)")
    data["gpus"] = gpus
    results = [gpu_count(cfg, gpus, "{index} {uuid}", started), gpu_ecc(cfg, gpus, started),
               gpu_remap(gpus, started), gpu_pcie(gpus, started),
               gpu_clocks(gpus, started), gpu_fabric(cfg, gpus, started)]
    try:
        nvlink, data["links"], data["nvlink_errors"] = gpu_nvlink(
            cfg, gpus, state, time.monotonic())
    except Exception as exc:  # noqa: BLE001 - its own error; the XML checks stand
        nvlink = crashed("gpu_nvlink", "", exc, started)
    return results + [nvlink], data


GPU_CHECKS = ("gpu", "gpu_ecc", "gpu_remap", "gpu_pcie", "gpu_clocks", "gpu_fabric",
              "gpu_nvlink")
# What the operator does about a fatal Xid (NVIDIA's Xid catalog); others: reset the GPU
XID_ACTIONS = {
    48: "drain the host and reset the GPU; replace it if double-bit errors come back",
    64: "drain the host and reset the GPU; replace it if the row remap fails again",
    74: "NVLink error: reset the GPU; if it comes back, the NVLink or baseboard needs service",
    79: "the GPU fell off the bus: reboot the host; reseat or replace it if it happens again",
    95: "uncontained ECC error: drain the host and reset the GPU",
    119: "GSP timeout: reset the GPU; reboot if the reset fails",
    120: "GSP error: reset the GPU; reboot if the reset fails",
    154: "do what the driver's message asks (GPU reset or node reboot)",
}
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id():
    try:
        with open(BOOT_ID, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def journal_entry(text):
    """One line of `journalctl -o json`: (the entry, its MESSAGE as text); ValueError for
    a line that is not a journal entry."""
    entry = json.loads(text)
    if not isinstance(entry, dict):
        raise ValueError("not an object")
    line = entry.get("MESSAGE") or ""
    if isinstance(line, list):  # journald's form of a message that is not UTF-8
        line = bytes(x & 0xFF for x in line if isinstance(x, int)).decode("utf-8", "replace")
    return entry, line if isinstance(line, str) else ""


def journal_from(cursor):
    """journalctl's argument to read on from a kept cursor: --cursor, and the reader drops
    the entry whose __CURSOR is the cursor (read the last time). Not --after-cursor:
    journalctl (systemd 252) skips one entry past the cursor's position even where that
    entry is gone (its journal file vacuumed or removed), so the first entry after it went
    unseen. --cursor starts at the cursor's entry where it exists, else at the first one
    after its position."""
    return "--cursor=" + cursor


def check_xid(cfg, state, gpus=()):
    """Xid events read from the kernel log exactly once (a journal cursor kept in the state
    file). A fatal one stays red until the host reboots (a new boot id) or the operator
    clears it after resetting the GPU (healthcheck.py --clear-xid)."""
    started = time.monotonic()
    boot = boot_id()
    if state.get("boot_id") != boot:  # a reboot resets every GPU: start over
        for key in ("journal_cursor", "xid_fatal", "xid_counts"):
            state.pop(key, None)
        state["boot_id"] = boot
    fatal = state.setdefault("xid_fatal", {})
    # every Xid this boot, by the PCI address its message names: {pci: {code: n}}. A
    # state file of a checker before per-GPU counts holds {code: n} and does not say
    # which GPU: those counts start over (the journal cursor is kept, so no event is read
    # again; the series without a pci label ends)
    counts = state.get("xid_counts")
    if not isinstance(counts, dict) or not all(isinstance(v, dict) for v in counts.values()):
        counts = state["xid_counts"] = {}
    if shutil.which("journalctl") is None:
        return result("gpu_xid", "", NA, "journalctl not found", started), counts
    # -k: this boot's kernel messages; JSON carries each entry's cursor (--show-cursor
    # exits 1 when nothing is new, as in a container whose journal has no kernel message)
    argv = ["journalctl", "-k", "-o", "json", "--output-fields=MESSAGE", "--no-pager", "-q"]
    cursor = state.get("journal_cursor")
    if cursor:
        argv.append(journal_from(cursor))
    # filtered here rather than with -g: journalctl may be built without pattern support
    rc, out, err = run(argv, 20)
    if rc != 0:  # the checker's tool failed: its own alert (error), never a drain
        return result("gpu_xid", "", ERROR, "journalctl -k: {}: the kernel log could not be "
                      "read, no Xid seen (not drained). Action: check systemd-journald".format(
                          first_line(err) or f"exited {rc}"), started), counts
    unreadable = []  # output this check cannot read fails it: an Xid may hide there
    for text in out.splitlines():
        try:
            entry, line = journal_entry(text)
        except ValueError:
            unreadable.append(text)
            continue
        if cursor and entry.get("__CURSOR") == cursor:  # read the last time
            continue
        state["journal_cursor"] = entry.get("__CURSOR") or state.get("journal_cursor")
        match = XID_RE.search(line)
        if not match:
            continue
        code, pci = int(match.group(2)), pci_key(match.group(1))
        per_gpu = counts.setdefault(pci, {})
        per_gpu[str(code)] = per_gpu.get(str(code), 0) + 1
        if code in cfg["xid_fatal"]:
            seen = fatal.setdefault(pci, {}).setdefault(
                str(code), {"first": time.time(), "count": 0})
            seen["count"] += 1
            seen["message"] = line.strip()[-200:]
    problems = []
    if unreadable:
        problems.append(f"journalctl -k -o json gave {len(unreadable)} line(s) that are not "
                        f"journal JSON (first: {unreadable[0][:80]!r}). Action: check "
                        "journalctl and systemd-journald")
    if fatal:
        by_pci = {pci_key(g["bus_id"]): g for g in gpus}
        for pci, codes in sorted(fatal.items()):
            gpu = by_pci.get(pci)
            name = gpu_name(gpu) if gpu else "GPU at PCI " + pci
            for code, seen in sorted(codes.items(), key=lambda item: int(item[0])):
                problems.append("Xid {} on {} ({}x since {}). Action: {}".format(
                    code, name, seen["count"], time.strftime(
                        "%Y-%m-%d %H:%M:%S", time.localtime(seen["first"])),
                    XID_ACTIONS.get(int(code), "drain the host and reset the GPU")))
        problems[-1] += (" (red until a reboot, or healthcheck.py --clear-xid PCI after the "
                         "GPU reset)")
    if problems:  # unreadable output alone is the tool's trouble, a fatal Xid the GPU's
        return result("gpu_xid", "", FAIL if fatal else ERROR, "; ".join(problems),
                      started), counts
    seen = ", ".join(f"Xid {c} x{n} on {pci}" for pci, codes in sorted(counts.items())
                     for c, n in sorted(codes.items(), key=lambda i: int(i[0]))) or "none"
    return result("gpu_xid", "", OK, f"no fatal Xid this boot ({seen})", started), counts


# ------------------------------------------------------------------------------ AMD

# amd-smi's JSON as amd-smi 25.x and 26.x (ROCm 6.4, 7.0) write it (ROCm/amdsmi,
# amdsmi_cli/amdsmi_commands.py and amdsmi_parser.py): `list` gives each GPU's "gpu",
# "bdf" and "uuid"; `static` its "asic" {"market_name", "asic_serial"} and "ras"
# {"ecc_block_state": {"UMC": "ENABLED", ...}} (amdsmi_ras_err_state_t names); `metric
# -e -k -t` its "ecc" {"total_uncorrectable_count", ...}, "ecc_blocks" {"UMC":
# {"correctable_count", "uncorrectable_count", "deferred_count"}, ...} and "temperature"
# {"edge", "hotspot", "mem"}, numbers as {"value": 63, "unit": "C"}, "N/A" where not
# supported; `xgmi -l` {"link_status": [{"gpu", "bdf", "link_status": ["U", "D", "X"]}]}
# (Up, Down, Disabled): per XGMI port in 25.x, per peer GPU in 26.x, with "SELF" and
# "U/U" for two links to one peer. ROCm 6.4 and later wrap the GPUs in {"gpu_data": [...]}.
AMD_GPU_CHECKS = ("gpu", "gpu_ecc", "gpu_thermal", "gpu_xgmi")
# amdsmi_ras_err_state_t states that report an error (SING_C: corrected)
RAS_ERROR_STATES = ("PARITY", "MULT_UC", "POISON")


def amd_json(cfg, *args):
    """(parsed `amd-smi ARGS --json`, None) with the GPUs' list unwrapped, or (None, why)
    when amd-smi fails. Output that is not JSON raises: the check is an error."""
    rc, out, err = run(["amd-smi", *args, "--json"], cfg["timeout_s"])
    if rc != 0:
        why = first_line(err) or first_line(out) or f"exited {rc}"
        return None, "amd-smi {}: {}".format(" ".join(args), why)
    data = json.loads(out)
    if isinstance(data, dict) and "gpu_data" in data:
        data = data["gpu_data"]
    return data, None


def amd_value(item):
    """A number amd-smi gives bare or as {"value": 63, "unit": "C"}; None for "N/A"."""
    if isinstance(item, dict):
        item = item.get("value")
    return item if isinstance(item, (int, float)) and not isinstance(item, bool) else None


def amd_obj(item):
    return item if isinstance(item, dict) else {}


def amd_gpus(listed, static, metric):
    """Per-GPU data from `amd-smi list`, `static` and `metric`, with check_nvidia's fields
    where AMD has the like (the NVIDIA metrics then apply) and None where it has not."""
    static = {s.get("gpu"): s for s in static if isinstance(s, dict)}
    metric = {m.get("gpu"): m for m in metric if isinstance(m, dict)}
    gpus = []
    for row in listed:
        index = row["gpu"]
        info, values = static.get(index, {}), metric.get(index, {})
        asic = amd_obj(info.get("asic"))
        blocks = {block: {kind.replace("_count", ""): amd_value(n) for kind, n in amd_obj(
            counts).items() if amd_value(n) is not None}
            for block, counts in amd_obj(values.get("ecc_blocks")).items()}
        total = amd_value(amd_obj(values.get("ecc")).get("total_uncorrectable_count"))
        hotspot = amd_value(amd_obj(values.get("temperature")).get("hotspot"))
        gpus.append({
            "index": index, "uuid": row.get("uuid") or asic.get("asic_serial"),
            "bus_id": row.get("bdf"), "name": asic.get("market_name"),
            "ras_errors": blocks,
            "ras_state": amd_obj(amd_obj(info.get("ras")).get("ecc_block_state")),
            "xgmi_links": {},
            # AMD's counts are since the driver loaded: NVIDIA's volatile ones
            "ecc_errors": {"volatile": {"uncorrectable": total},
                           "aggregate": {"uncorrectable": None}},
            "temperature_c": hotspot, "remapped_rows": {}, "remapped_rows_pending": None,
            "retirement_pending": None, "remapped_rows_failure": None, "clock_events": {},
            "pcie": dict.fromkeys(("gen_current", "gen_max", "width_current", "width_max")),
            "fabric": {"state": None, "status": None}})
    return gpus


def amd_reset(gpu):
    return f"drain the host and reset the GPU (amd-smi reset --gpureset -g {gpu['index']})"


def amd_ecc(gpus, started):
    """Uncorrectable ECC errors per RAS block (XGMI_WAFL's are gpu_xgmi's) and RAS blocks
    in an error state."""
    problems = []
    for gpu in gpus:
        for block, counts in sorted(gpu["ras_errors"].items()):
            if block != "XGMI_WAFL" and counts.get("uncorrectable"):
                problems.append("{}: {} uncorrectable ECC errors in {} since the driver loaded. "
                                "Action: {}; replace it if they come back".format(
                                    gpu_name(gpu), counts["uncorrectable"], block,
                                    amd_reset(gpu)))
        total = gpu["ecc_errors"]["volatile"]["uncorrectable"]
        if not gpu["ras_errors"] and total:
            problems.append(f"{gpu_name(gpu)}: {total} uncorrectable ECC errors since the "
                            f"driver loaded. Action: {amd_reset(gpu)}; replace it if they "
                            "come back")
        for block, state in sorted(gpu["ras_state"].items()):
            if state in RAS_ERROR_STATES:
                problems.append(f"{gpu_name(gpu)}: RAS block {block} reports {state}. "
                                f"Action: {amd_reset(gpu)}; replace it if it comes back")
    if not problems and not any(g["ras_errors"] or g["ecc_errors"]["volatile"]["uncorrectable"]
                                is not None for g in gpus):
        return result("gpu_ecc", "", NA, "amd-smi reports no ECC counts (no RAS here)", started)
    return verdict("gpu_ecc", problems, "no uncorrectable ECC errors, no RAS block in an "
                   "error state", started)


def amd_thermal(cfg, gpus, started):
    limit = cfg["temperature_max_c"]
    temps = [g["temperature_c"] for g in gpus if g["temperature_c"] is not None]
    if not temps:
        return result("gpu_thermal", "", NA, "amd-smi reports no hotspot temperature", started)
    problems = [f"{gpu_name(g)}: hotspot {g['temperature_c']} C, above {limit} C. Action: "
                "check the GPU's cooling (fans, air flow, inlet temperature) and the BMC "
                "event log; it throttles and then shuts down when hotter"
                for g in gpus if g["temperature_c"] is not None and g["temperature_c"] > limit]
    return verdict("gpu_thermal", problems, f"hotspot at most {max(temps)} C (limit {limit} C)",
                   started)


def amd_xgmi(cfg, gpus, started):
    """XGMI links down (`amd-smi xgmi -l`) and uncorrectable XGMI errors: the XGMI_WAFL RAS
    block's (metric's xgmi_err is N/A from MI300 on)."""
    data, why = amd_json(cfg, "xgmi", "--link-status")
    if why:
        return result("gpu_xgmi", "", FAIL, f"{why}. Action: check the amdgpu driver (dmesg)",
                      started)
    rows = data.get("link_status", []) if isinstance(data, dict) else data
    by_index = {g["index"]: g for g in gpus}
    problems, up, linked = [], 0, 0
    for row in rows:
        states = row.get("link_status")
        found = [(n, s) for n, item in enumerate(states if isinstance(states, list) else [])
                 for s in str(item).split("/") if s in ("U", "D", "X")]
        if not found:
            continue
        links = {name: sum(1 for _, s in found if s == code)
                 for name, code in (("up", "U"), ("down", "D"), ("disabled", "X"))}
        gpu = by_index.get(row.get("gpu"))
        if gpu:
            gpu["xgmi_links"] = links
        up, linked = up + links["up"], linked + 1
        down = sorted({n for n, s in found if s == "D"})
        if down:
            name = gpu_name(gpu) if gpu else "GPU {} ({})".format(row.get("gpu"), row.get("bdf"))
            problems.append("{}: XGMI link {} down ({} of {} up). Action: reset the GPU "
                            "(amd-smi reset --gpureset -g {}) or reboot; if it stays down, the "
                            "XGMI link or the baseboard needs service".format(
                                name, ", ".join(map(str, down)), links["up"],
                                links["up"] + links["down"], row.get("gpu")))
    for gpu in gpus:
        errors = gpu["ras_errors"].get("XGMI_WAFL", {}).get("uncorrectable")
        if errors:
            problems.append(f"{gpu_name(gpu)}: {errors} uncorrectable XGMI errors (RAS block "
                            f"XGMI_WAFL) since the driver loaded. Action: {amd_reset(gpu)}; if "
                            "they come back, the XGMI link or the baseboard needs service")
    if not linked and not problems:
        return result("gpu_xgmi", "", NA, "no XGMI links on these GPUs", started)
    return verdict("gpu_xgmi", problems, f"{up} XGMI links up on {linked} GPUs, no "
                   "uncorrectable XGMI errors", started)


def check_amd(cfg):
    """The AMD GPU checks from `amd-smi list`, `static`, `metric` and `xgmi` (JSON);
    returns (results, per-GPU data for the metrics)."""
    started = time.monotonic()
    data = {"gpus": []}

    def only(check_status, detail, rest):
        return gpu_only(AMD_GPU_CHECKS, check_status, detail, rest, started), data

    if shutil.which("amd-smi") is None:
        return only(FAIL, "amd-smi not found, but this host's plan uses AMD GPUs. Action: "
                    "install ROCm (the rocm role)", "no data: amd-smi not found (see the gpu "
                    "check)")
    listed, why = amd_json(cfg, "list")
    if not why:
        static, why = amd_json(cfg, "static")
    if not why:
        metric, why = amd_json(cfg, "metric", "--ecc", "--ecc-blocks", "--temperature")
    if why:
        return only(FAIL, f"{why}. Action: check the amdgpu driver (dmesg), reboot if it does "
                    "not answer", "no data: amd-smi failed (see the gpu check)")
    gpus = data["gpus"] = amd_gpus(listed, static, metric)
    results = [gpu_count(cfg, gpus, "{index} {uuid} {bus_id}", started),
               amd_ecc(gpus, started), amd_thermal(cfg, gpus, started)]
    try:
        xgmi = amd_xgmi(cfg, gpus, time.monotonic())
    except Exception as exc:  # noqa: BLE001 - its own error; the other checks stand
        xgmi = crashed("gpu_xgmi", "", exc, started)
    return results + [xgmi], data


def read_text(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return None


def ib_ports(root, devices):
    """[{hca, port, state, phys_state, rate_gbps, link_layer, counters}] from sysfs."""
    found = []
    names = devices or (sorted(os.listdir(root)) if os.path.isdir(root) else [])
    for hca in names:
        ports_dir = os.path.join(root, hca, "ports")
        ports = sorted(os.listdir(ports_dir), key=int) if os.path.isdir(ports_dir) else []
        if not ports:
            found.append({"hca": hca, "port": None})
        for port in ports:
            base = os.path.join(ports_dir, port)
            counters = {}
            for counter in IB_COUNTERS:
                value = read_text(os.path.join(base, "counters", counter))
                if value is not None and value.isdigit():
                    counters[counter] = int(value)
            rate = read_text(os.path.join(base, "rate")) or ""
            match = re.match(r"\s*([\d.]+)\s*Gb/sec", rate)
            found.append({
                "hca": hca, "port": int(port),
                # "4: ACTIVE", "5: LinkUp": the name after the number
                "state": (read_text(os.path.join(base, "state")) or "?").split(":")[-1].strip(),
                "phys_state": (read_text(os.path.join(base, "phys_state")) or "?").split(
                    ":")[-1].strip(),
                "rate_gbps": float(match.group(1)) if match else None,
                "link_layer": read_text(os.path.join(base, "link_layer")) or "",
                "counters": counters})
    return found


def check_ib(cfg, state):
    """The HCA ports the plan moves KV data over: up, at full rate, error counters steady.
    Returns (result, ports for the metrics)."""
    started = time.monotonic()
    ports = ib_ports(cfg["sysfs"], cfg["devices"])
    if not ports:
        return result("ib", "", FAIL, "no InfiniBand/RoCE device under {}, but this host's "
                      "plan moves data over RDMA. Action: check the HCA (lspci), its driver "
                      "(mlx5_ib) and the rdma role".format(cfg["sysfs"]), started), []
    problems = []
    live = [p for p in ports if p["port"] is not None]
    for missing in (p for p in ports if p["port"] is None):
        problems.append("HCA {}: not found under {}. Action: check the HCA and its driver "
                        "(lspci, dmesg)".format(missing["hca"], cfg["sysfs"]))
    best = max([p["rate_gbps"] or 0 for p in live] or [0])
    want = cfg["min_rate_gbps"] or best
    before, now = state.get("counters", {}), {}
    for p in live:
        name = "HCA {} port {}".format(p["hca"], p["port"])
        if p["state"] != "ACTIVE" or p["phys_state"] != "LinkUp":
            problems.append(f"{name}: {p['state']} (physical {p['phys_state']}). Action: check "
                            "the cable, transceiver and switch port (ibstat; the switch's log)")
        elif p["rate_gbps"] is not None and p["rate_gbps"] < want:
            problems.append("{}: {:g} Gb/s, expected {:g}. Action: the link trained below its "
                            "speed: reseat or replace the cable or transceiver, check the "
                            "switch port's speed".format(name, p["rate_gbps"], want))
        key = "{}/{}".format(p["hca"], p["port"])
        now[key] = p["counters"]
        for counter, rise, limit in counter_rises(before.get(key, {}), p["counters"],
                                                  cfg["error_delta_max"]):
            problems.append(f"{name}: {counter} rose by {rise} since the last run (more "
                            f"than {limit}). Action: the link is flapping or degrading: "
                            "check the cable and the switch port")
    state["counters"] = now
    return verdict("ib", problems, f"{len(live)} ports ACTIVE/LinkUp at {want:g} Gb/s or more, "
                   "error counters steady", started), live


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


def gateway_state(state):
    """state["gateway"] made whole, in place: {"journal_cursor": the last entry read,
    "responses": {status code: n}, "unparsed": n}; counts not of that shape (a damaged
    file) start over."""
    responses = state.get("responses")
    if not isinstance(responses, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for n in responses.values()):
        state["responses"] = {}
    unparsed = state.get("unparsed")
    if not isinstance(unparsed, int) or isinstance(unparsed, bool) or unparsed < 0:
        state["unparsed"] = 0
    if not isinstance(state.get("journal_cursor"), str):
        state.pop("journal_cursor", None)
    return state


def check_gateway(cfg, state):
    """The API gateway's responses by status code, from its access log in the journal
    (entries with SYSLOG_IDENTIFIER log_tag), each entry read exactly once: a journal
    cursor kept in the state file, as check_xid's, moved with the counts entry by entry.
    The counts add up in the state file across runs, restarts and reboots (counters).
    Returns (result, state["gateway"]). Never a fail: journalctl failing or printing what
    is not journal JSON is an error (the checker's own trouble), a line not in the log
    format is counted as unparsed. A run reads for at most GATEWAY_READ_S seconds; the
    next one goes on from where it stopped (the first run after install reads this
    boot's entries, maybe many)."""
    started = time.monotonic()
    gateway = gateway_state(state)
    responses, tag = gateway["responses"], cfg["log_tag"]
    if shutil.which("journalctl") is None:
        return result("gateway_log", "", ERROR, "journalctl not found: the gateway's access "
                      f"log ({tag}) cannot be read", started), gateway
    cursor = gateway.get("journal_cursor")
    argv = ["journalctl", "-t", tag, "-o", "json", "--output-fields=MESSAGE", "--no-pager",
            "-q", journal_from(cursor) if cursor else "-b"]
    new, unparsed, unreadable, first = {}, 0, 0, ""
    stopped = []

    def stop():  # journalctl still writing after GATEWAY_READ_S: the rest is the next run's
        if proc.poll() is None:
            stopped.append(True)
            proc.kill()

    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=err, encoding="utf-8", errors="replace")
        timer = threading.Timer(GATEWAY_READ_S, stop)
        timer.daemon = True
        timer.start()
        try:
            for text in proc.stdout:
                if not text.endswith("\n") and stopped:  # cut off by the kill
                    break
                try:
                    entry, line = journal_entry(text)
                except ValueError:
                    unreadable += 1
                    first = first or text.strip()
                    continue
                if cursor and entry.get("__CURSOR") == cursor:  # read the last time
                    continue
                gateway["journal_cursor"] = entry.get("__CURSOR") or gateway.get(
                    "journal_cursor")
                match = GATEWAY_LINE_RE.fullmatch(line.strip())
                if match:
                    code = match.group(1)
                    responses[code] = responses.get(code, 0) + 1
                    new[code] = new.get(code, 0) + 1
                else:
                    unparsed += 1
                    gateway["unparsed"] += 1
        finally:
            timer.cancel()
            proc.stdout.close()
            rc = proc.wait()
        err.seek(0)
        why = first_line(err.read().decode("utf-8", "replace")) or f"exited {rc}"
    read = sum(new.values()) + unparsed
    detail = "{} responses since the last run{}".format(sum(new.values()), ": " + ", ".join(
        f"{code} x{n}" for code, n in sorted(new.items())) if new else "")
    if unparsed:
        detail += f"; {unparsed} line(s) not in the gateway's log format (counted as unparsed)"
    problems = []
    if stopped and not read:
        problems.append(f"journalctl -t {tag} gave nothing within {GATEWAY_READ_S}s")
    elif stopped:
        detail += f" (read for {GATEWAY_READ_S}s: the next run reads on)"
    elif rc != 0:
        problems.append(f"journalctl -t {tag}: {why}")
    if unreadable:
        problems.append(f"journalctl -t {tag} -o json gave {unreadable} line(s) that are not "
                        f"journal JSON (first: {first[:80]!r})")
    if problems:  # the checker's own trouble: its own alert (error), never a drain
        return result("gateway_log", "", ERROR, "{}: the gateway's access log could not be "
                      "read whole, the responses in it are not all counted. Action: check "
                      "systemd-journald ({})".format("; ".join(problems), detail),
                      started), gateway
    return result("gateway_log", "", OK, detail, started), gateway


# ------------------------------------------------------------------------------ state


def load_state(path, log):
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
        if not isinstance(state.get("units"), dict):
            raise ValueError("no units")
        for key in ("gpu", "ib", "gateway"):  # gateway: absent before the gateway job
            if not isinstance(state.setdefault(key, {}), dict):
                raise ValueError(f"{key} is not an object")
        return state
    except FileNotFoundError:
        return {"version": 1, "units": {}, "gpu": {}, "ib": {}, "gateway": {}}
    except (OSError, ValueError, AttributeError) as exc:
        log(f"state file {path} unreadable ({exc}): starting from empty state")
        return {"version": 1, "units": {}, "gpu": {}, "ib": {}, "gateway": {}}


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


# Host checks whose failure no unit restart can fix (a GPU that needs a reset, a link
# down): while one fails, the units' failures are not counted (no restart loop on a dead
# GPU). Slowdowns, PCIe width and cache room degrade a host without killing its engines.
HOST_FAULT_CHECKS = ("gpu", "gpu_ecc", "gpu_remap", "gpu_fabric", "gpu_nvlink", "gpu_xgmi",
                     "gpu_xid", "ib")


def host_faults(results):
    """The failed host checks that hold restarts, as "check" names."""
    return sorted({r["check"] for r in results
                   if not r["unit"] and r["check"] in HOST_FAULT_CHECKS and r["status"] == FAIL})


def decide_restarts(cfg, statuses, failed, state, log, act, errored=(), held=()):
    """Advance failure streaks and restart units; returns {unit: decision text}. A unit
    whose checks only raised (errored) keeps its streak as it was: no evidence either way;
    so does every unit while a host fault holds restarts (held: the failed host checks)."""
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
        if held:
            decisions[name] = ("not counted: the host is sick ({} failed); a restart cannot "
                               "fix it".format(", ".join(held)))
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


def drain_faults(cfg, held, statuses):
    """The host faults that drain the host: all held ones, except the GPU fabric's state
    while a host service (the fabric manager, IMEX) is down. That state follows the
    service, the engines already running keep their NVLink mappings and serve, and stopped
    they could not start again until the service is back: its own check names the fix."""
    services_down = [u for u in cfg["units"] if u["role"] == "host" and
                     statuses.get(u["unit"], {}).get("active_state") != "active"]
    return [c for c in held if not (c == "gpu_fabric" and services_down)]


def drain(cfg, state, statuses, held, log, lost=False):
    """Take a sick host's engines out of service, and back once it is healthy. A run that
    finds a host fault that drains (drain_faults) counts toward the drain, one that finds
    no host fault toward the return (state["drain_runs"]); once cfg["drain"]'s after_runs
    (return_after_runs) runs in a row did, and not within its cooldown_s of the last
    change the other way, the engine units that run are stopped (systemd's SIGTERM makes
    vLLM and SGLang finish and close their ports, so the routers' health checks and
    circuit breakers send elsewhere, and makes a Dynamo worker deregister from discovery)
    or exactly those it stopped are started. state["drained"] lists them; where the state
    file was lost (lost), the enabled engine units that systemd has stopped are taken as
    drained (a reboot starts them, a redeploy too: both harmless)."""
    policy = cfg["drain"]
    names = {u["unit"] for u in cfg["units"]}
    drained = [n for n in state.get("drained") or [] if n in names]
    if lost and policy["enabled"] and not drained:
        drained = [u["unit"] for u in cfg["units"] if u["drain"] and
                   statuses.get(u["unit"], {}).get("active_state") == "inactive" and
                   statuses[u["unit"]].get("enabled")]
        if drained:
            log("INFO drain    - the state file was lost: taking the enabled, stopped "
                "engines as drained: " + ", ".join(drained))
    runs = state.setdefault("drain_runs", {"failing": 0, "passing": 0, "last": None})
    draining = drain_faults(cfg, held, statuses)
    runs["failing"], runs["passing"] = (runs["failing"] + 1, 0) if draining else (
        (0, runs["passing"] + 1) if not held else (0, 0))
    last = runs.get("last") or {}

    def cooling(other):
        since = time.time() - last.get("at", 0)
        if last.get("what") == other and since < policy["cooldown_s"]:
            return "{:.0f}s after the last {}, cooldown {:g}s".format(since, other,
                                                                      policy["cooldown_s"])
        return None

    def systemctl(verb, name, done):
        rc, _, err = run(["systemctl", verb, "--no-block", name], 30)
        if rc == 0:
            log(f"drain {name}: {done}")
        else:
            log(f"FAIL drain   {name} systemctl {verb} failed: {first_line(err) or rc}")
        return rc == 0

    running = [u["unit"] for u in cfg["units"] if u["drain"] and
               u["unit"] not in drained and statuses.get(u["unit"], {}).get(
                   "active_state") in ("active", "activating", "reloading")]
    if draining and policy["enabled"] and running:
        wait = cooling("return")
        if runs["failing"] < policy["after_runs"]:
            log("INFO drain    - {} failed in {} of the {} runs in a row that drain the "
                "host".format(", ".join(draining), runs["failing"], policy["after_runs"]))
        elif wait:
            log(f"INFO drain    - {', '.join(draining)} failed; not draining yet: {wait}")
        else:
            why = ("stopped while the host is sick ({}); started again once its checks "
                   "pass".format(", ".join(draining)))
            drained += [n for n in running if systemctl("stop", n, why)]
            runs["last"] = {"what": "drain", "at": time.time()}
    elif not held and drained:
        wait = cooling("drain")
        if runs["passing"] < policy["return_after_runs"]:
            log("INFO drain    - the host passed {} of the {} runs in a row before its "
                "engines start".format(runs["passing"], policy["return_after_runs"]))
        elif wait:
            log(f"INFO drain    - the host is healthy; engines start later: {wait}")
        else:
            drained = [n for n in drained
                       if not systemctl("start", n, "the host is healthy again, started")]
            runs["last"] = {"what": "return", "at": time.time()}
    if drained:
        state["drained"] = drained
    else:
        state.pop("drained", None)
    return drained


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


def gpu_families(gpu, xids, fatal):
    """The per-GPU metric families: gpu is check_nvidia's or check_amd's data."""
    gpus = gpu.get("gpus") or []
    families = []

    def per_gpu(name, kind, text, values):
        samples = []
        for g in gpus:
            for labels, value in values(g):
                if value is not None:
                    samples.append((dict({"gpu": g["index"], "uuid": g["uuid"] or ""}, **labels),
                                    value))
        if samples:
            families.append((name, kind, text, samples))

    per_gpu("gpufleet_gpu_info", "gauge", "1 per GPU the driver sees, with its identity.",
            lambda g: [({"pci": g["bus_id"] or "", "name": g["name"] or ""}, 1)])
    per_gpu("gpufleet_gpu_ecc_uncorrected_errors", "gauge",
            "Uncorrected ECC errors per GPU (volatile: since the driver loaded; aggregate: "
            "lifetime).", lambda g: [({"counter": c}, g["ecc_errors"][c]["uncorrectable"])
                                     for c in ("volatile", "aggregate")])
    per_gpu("gpufleet_gpu_remapped_rows", "gauge", "Rows remapped, by error kind.",
            lambda g: [({"kind": k}, v) for k, v in sorted(g["remapped_rows"].items())])
    per_gpu("gpufleet_gpu_remap_pending", "gauge",
            "1 when a row remap (or page retirement) waits for a GPU reset.",
            lambda g: [({}, None if g["remapped_rows_pending"] is None and
                        g["retirement_pending"] is None else
                        bool(g["remapped_rows_pending"] or g["retirement_pending"]))])
    per_gpu("gpufleet_gpu_remap_failed", "gauge", "1 when row remapping failed (RMA).",
            lambda g: [({}, g["remapped_rows_failure"])])
    per_gpu("gpufleet_gpu_pcie_link_gen", "gauge", "PCIe generation, current and maximum.",
            lambda g: [({"which": w}, g["pcie"]["gen_" + w]) for w in ("current", "max")])
    per_gpu("gpufleet_gpu_pcie_link_width", "gauge", "PCIe lanes, current and maximum.",
            lambda g: [({"which": w}, g["pcie"]["width_" + w]) for w in ("current", "max")])
    per_gpu("gpufleet_gpu_clock_event_active", "gauge",
            "1 while the clock event reason holds the GPU's clocks down.",
            lambda g: [({"reason": r}, g["clock_events"].get(r))
                       for r in ("sw_power_cap",) + tuple(CLOCK_FAULTS)])
    per_gpu("gpufleet_gpu_temperature_celsius", "gauge",
            "GPU core temperature (AMD: hotspot, the junction's hottest point).",
            lambda g: [({}, g["temperature_c"])])
    per_gpu("gpufleet_gpu_fabric_ok", "gauge",
            "1 when the GPU's NVLink fabric is Completed/Success (NVSwitch systems only).",
            lambda g: [({}, gpu_facts.fabric_ok(g["fabric"]) if g["fabric"]["state"]
                        else None)])
    links, errors = gpu.get("links") or {}, gpu.get("nvlink_errors") or {}
    per_gpu("gpufleet_gpu_nvlink_links", "gauge", "NVLink links by state.",
            lambda g: [({"state": st}, sum(1 for link in links[g["index"]]
                                           if link["active"] == (st == "active")))
                       for st in ("active", "inactive")] if g["index"] in links else [])
    per_gpu("gpufleet_gpu_nvlink_errors", "gauge",
            "NVLink error counters summed over the GPU's links, since the driver loaded.",
            lambda g: [({"counter": c}, v) for c, v in sorted(
                errors.get(g["index"], {}).items())])
    per_gpu("gpufleet_gpu_ras_errors", "gauge",
            "RAS error counts per GPU block since the driver loaded (AMD).",
            lambda g: [({"block": b, "kind": k}, v) for b, counts in sorted(
                g.get("ras_errors", {}).items()) for k, v in sorted(counts.items())])
    per_gpu("gpufleet_gpu_xgmi_links", "gauge", "XGMI links by state (AMD).",
            lambda g: [({"state": st}, n) for st, n in sorted(g.get("xgmi_links", {}).items())])
    if xids is not None:
        families.append(("gpufleet_gpu_xid_events_total", "counter",
                         "Xid events read from the kernel log this boot, per GPU (the PCI "
                         "address the Xid message names).",
                         [({"pci": pci, "xid": code}, n) for pci, codes in sorted(xids.items())
                          for code, n in sorted(codes.items(), key=lambda item: int(item[0]))]))
    families.append(("gpufleet_gpu_xid_fatal", "gauge",
                     "1 while a fatal Xid on the GPU at this PCI address is unresolved (until "
                     "a reboot, or --clear-xid after a GPU reset).",
                     [({"pci": pci, "xid": code}, 1) for pci, codes in sorted(fatal.items())
                      for code in sorted(codes, key=int)]))
    return families


def metrics(cfg, results, statuses, state, gpu, xids, free, ib, ran_at, took, held=()):
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
    families += gpu_families(gpu, xids, state.get("gpu", {}).get("xid_fatal", {}))
    if ib:
        port = [({"hca": p["hca"], "port": p["port"]}, p) for p in ib]
        families += [
            ("gpufleet_ib_port_up", "gauge", "1 when the port is ACTIVE and LinkUp.",
             [(labels, p["state"] == "ACTIVE" and p["phys_state"] == "LinkUp")
              for labels, p in port]),
            ("gpufleet_ib_port_rate_gbps", "gauge", "The port's current rate.",
             [(labels, p["rate_gbps"]) for labels, p in port if p["rate_gbps"] is not None]),
            ("gpufleet_ib_port_errors", "gauge", "The port's error counters (sysfs).",
             [(dict(labels, counter=c), v) for labels, p in port
              for c, v in sorted(p["counters"].items())]),
        ]
    if cfg["gateway"]:  # the counts in the state file: there whatever this run read
        gateway = gateway_state(dict(state.get("gateway") or {}))
        families += [
            ("gpufleet_gateway_responses_total", "counter",
             "Responses of the API gateway by HTTP status code, from its access log in the "
             "journal (each entry counted once; kept in the state file).",
             [({"code": code}, n) for code, n in sorted(gateway["responses"].items())]),
            ("gpufleet_gateway_log_unparsed_total", "counter",
             "Lines of the API gateway's access log not in its log format (not counted by "
             "status code).", [({}, gateway["unparsed"])]),
        ]
    families.append(("gpufleet_health_last_run_timestamp_seconds", "gauge",
                     "Unix time the health checker last finished a run.", [({}, ran_at)]))
    families.append(("gpufleet_host_fault", "gauge",
                     "1 while this host check fails and holds the units' restarts (a GPU that "
                     "needs a reset, a link down): the host should be drained.",
                     [({"check": c}, c in held) for c in HOST_FAULT_CHECKS
                      if any(r["check"] == c and r["status"] != NA for r in results)]))
    families.append(("gpufleet_unit_drained", "gauge",
                     "1 while the checker holds the engine unit stopped because the host is "
                     "sick (drain); it starts it again once the host checks pass.",
                     [({"unit": u["unit"]}, u["unit"] in (state.get("drained") or []))
                      for u in cfg["units"] if u["drain"]]))
    families.append(("gpufleet_health_run_duration_seconds", "gauge",
                     "Wall time of the checker's last run.", [({}, took)]))
    return render_metrics(families)


# ------------------------------------------------------------------------------ main


def deploy_holder(path, now=None):
    """Who deploys to this host now (the deploy lock's holder, unexpired), else None."""
    try:
        with open(path, encoding="utf-8") as handle:
            lock = json.load(handle)
    except (OSError, ValueError):
        return None
    expires = lock.get("expires") if isinstance(lock, dict) else None
    if not isinstance(expires, (int, float)) or expires <= (now or time.time()):
        return None
    return str(lock.get("holder") or "a deploy")


def take_lock(path, wait_s):
    """(the state lock's file, held; None) or (None, why not) after waiting up to wait_s
    for a run that holds it: a stuck run makes the next ones observe only, never wait
    forever."""
    try:
        handle = open(path, "a")  # noqa: SIM115 - held until the run's files are written
    except OSError as exc:
        return None, f"state lock {path}: {exc}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle, None
        except OSError as exc:
            busy = exc.errno in (errno.EAGAIN, errno.EACCES)
            if not busy or time.monotonic() > deadline:
                handle.close()
                return None, (
                    f"another run has held {path} for over {wait_s:g}s: this run observes "
                    "only (no restart, no drain, state unchanged). Action: find the stuck "
                    "run (systemctl status gpufleet-health gpufleet-health-watch)"
                    if busy else f"state lock {path}: {exc}")
            time.sleep(0.2)


def clear_xid(cfg, which, log):
    """Forget fatal Xids of the GPU at PCI address `which` (or `all`) after its reset."""
    path = cfg["state_file"]
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = load_state(path, log)
        fatal = state["gpu"].get("xid_fatal", {})
        gone = sorted(fatal) if which == "all" else [k for k in fatal if k == pci_key(which)]
        if not gone:
            log("no fatal Xid recorded for {} (recorded: {})".format(
                which, ", ".join(sorted(fatal)) or "none"))
            return 1
        for key in gone:
            del fatal[key]
        atomic_write(path, json.dumps(state, indent=1, sort_keys=True) + "\n")
    log("cleared the fatal Xids of {}".format(", ".join(gone)))
    return 0


def host_jobs(cfg, state, out):
    """The host's checks in the order they run, as (name, its check names, function); the
    Xid check names GPUs from the GPU check's data in out."""
    def gpus():
        return ((out.get("nvidia") or ([], {}))[1] or {}).get("gpus", [])

    if cfg["gpu"]["vendor"] == "amd":
        jobs = [("amd", AMD_GPU_CHECKS, lambda: check_amd(cfg["gpu"]))]
    else:
        jobs = [("nvidia", GPU_CHECKS, lambda: check_nvidia(cfg["gpu"], state["gpu"]))]
    jobs.append(("gpu_xid", ("gpu_xid",), lambda: check_xid(cfg["gpu"], state["gpu"], gpus())))
    if cfg["ib"]:
        jobs.append(("ib", ("ib",), lambda: check_ib(cfg["ib"], state["ib"])))
    if cfg["cache"]:
        jobs.append(("cache", ("cache",), lambda: check_cache(cfg["cache"])))
    if cfg["gateway"]:  # last: a long read of its log holds up no host fault
        jobs.append(("gateway", ("gateway_log",),
                     lambda: check_gateway(cfg["gateway"], state["gateway"])))
    return jobs


def host_checks(jobs, out):
    """Run host_jobs one after the other; each one's results land in out[name] as
    (results, data) even when it raises."""
    for name, checks, fn in jobs:
        started = time.monotonic()
        try:
            found, data = fn()
            out[name] = (found if isinstance(found, list) else [found], data)
        except Exception as exc:  # noqa: BLE001 - a check that raises is an error, not a pass
            out[name] = ([crashed(c, "", exc, started) for c in checks], None)


# ------------------------------------------------------------------------------ watcher
# The timer's run (every minute) sees everything; the resident watcher sees a host fault
# within seconds: it follows the kernel log for Xids (journalctl -f: event-driven) and
# polls what a GPU or HCA fault changes (NVML through ctypes, or nvidia-smi -q -x where
# NVML cannot be loaded; the HCAs' sysfs). When any of it changes, it runs the host's
# checks (--host-only), which write the metrics and the state as the timer's run does.

NVML_SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW/HW thermal, HW power brake


class FabricInfo(ctypes.Structure):
    """nvmlGpuFabricInfo_t: clusterUuid[16], status (an nvmlReturn_t), cliqueId, state."""
    _fields_ = [("cluster_uuid", ctypes.c_char * 16), ("status", ctypes.c_int),
                ("clique_id", ctypes.c_uint), ("state", ctypes.c_ubyte)]


class Nvml:
    """The GPU fields a host fault changes, read through libnvidia-ml (a few microseconds per
    call; nvidia-smi -q -x costs tens of milliseconds per GPU). Every call's return code is
    part of what it reads: a GPU that falls off the bus changes it."""

    def __init__(self, lib):
        self.lib = lib

    @classmethod
    def open(cls, name="libnvidia-ml.so.1"):
        try:
            lib = ctypes.CDLL(name)
            if lib.nvmlInit_v2() != 0:
                return None
        except (OSError, AttributeError):
            return None
        return cls(lib)

    def _get(self, fn, handle, *args, kind=ctypes.c_uint, out=1):
        values = [kind() for _ in range(out)]
        func = getattr(self.lib, fn, None)
        if func is None:
            return ("missing",)
        rc = func(handle, *args, *(ctypes.byref(v) for v in values))
        return (rc,) + tuple(v.value for v in values) if rc == 0 else (rc,)

    def signature(self):
        count = ctypes.c_uint()
        rc = self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        gpus = [("count", rc, count.value)]
        for index in range(count.value if rc == 0 else 0):
            handle = ctypes.c_void_p()
            rc = self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
            if rc != 0:
                gpus.append((index, rc))
                continue
            # uncorrected errors (1) since boot (volatile, 0)
            ecc = self._get("nvmlDeviceGetTotalEccErrors", handle, 1, 0, kind=ctypes.c_ulonglong)
            # (rc, correctable, uncorrectable, pending, failed): the rows that moved and
            # whether a remap waits for a reset or failed
            remap = self._get("nvmlDeviceGetRemappedRows", handle, out=4)
            reasons = self._get("nvmlDeviceGetCurrentClocksEventReasons", handle,
                                kind=ctypes.c_ulonglong)
            fabric = FabricInfo()
            info = getattr(self.lib, "nvmlDeviceGetGpuFabricInfo", None)
            frc = info(handle, ctypes.byref(fabric)) if info else "missing"
            links = tuple(self._get("nvmlDeviceGetNvLinkState", handle, link)
                          for link in range(18))
            gpus.append((index, ecc, remap, reasons[:1] + tuple(
                r & NVML_SLOWDOWN for r in reasons[1:]), (frc, fabric.state, fabric.status),
                links))
        return gpus


def smi_signature(timeout):
    """The fields of nvidia-smi -q -x that the host checks fail on (no NVML here)."""
    gpus, why = nvidia_smi_gpus(timeout)
    if why:
        return ("nvidia-smi", why)
    return [(g["uuid"], g["bus_id"], g["ecc_errors"]["volatile"].get("uncorrectable"),
             g["remapped_rows_pending"], g["remapped_rows_failure"],
             tuple(g["clock_events"].get(c) for c in ("hw_slowdown", "hw_thermal_slowdown",
                                                      "hw_power_brake_slowdown")),
             g["fabric"]["state"], g["fabric"]["status"]) for g in gpus]


def ib_signature(cfg):
    return [(p["hca"], p["port"], p.get("state"), p.get("phys_state"), p.get("rate_gbps"),
             (p.get("counters") or {}).get("link_downed"),
             (p.get("counters") or {}).get("link_error_recovery"))
            for p in ib_ports(cfg["sysfs"], cfg["devices"])]


def follow_xids(wake, log, children):
    """Follow the kernel log; set wake on every Xid message. Restarts journalctl if it ends.
    children holds the journalctl now running (the watcher stops it when it exits)."""
    argv = ["journalctl", "-k", "-f", "-n", "0", "-o", "json", "--output-fields=MESSAGE",
            "-q", "--no-pager"]
    while True:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL)
        except OSError as exc:
            log(f"watch: journalctl: {exc}; Xids are seen by the timer's runs only")
            return
        children[:] = [proc]
        for line in proc.stdout:
            try:
                message = json.loads(line).get("MESSAGE") or ""
            except ValueError:
                continue
            if isinstance(message, list):
                message = bytes(message).decode("utf-8", "replace")
            if XID_RE.search(message):
                wake.set()
        proc.wait()
        log(f"watch: journalctl -k -f ended ({proc.returncode}); following again in 5 s")
        time.sleep(5)


def watch(config, cfg, log):
    """Stay resident; run the host's checks at start and whenever what they read changes."""
    nvml = Nvml.open() if cfg["gpu"]["vendor"] != "amd" else None
    smi = nvml is None and cfg["gpu"]["vendor"] == "nvidia" and shutil.which("nvidia-smi")
    log("watch: every {:g}s: {}{}, Xids from journalctl -k -f".format(
        cfg["watch"]["interval_s"], "GPUs through NVML" if nvml else
        "GPUs through nvidia-smi -q -x" if smi else "no GPU poll",
        ", HCA ports from sysfs" if cfg["ib"] else ""))
    wake = threading.Event()
    children = []
    # SIGTERM (systemd's stop, or anyone's) ends the loop through the finally below, which
    # stops the journalctl it follows: a watcher stopped outside its unit's cgroup left it
    # running, following the kernel log for nobody
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    if shutil.which("journalctl"):
        threading.Thread(target=follow_xids, args=(wake, log, children), daemon=True).start()
    last = None
    try:
        while True:
            now = {"gpu": nvml.signature() if nvml else smi_signature(
                cfg["gpu"]["timeout_s"]) if smi else None,
                "ib": ib_signature(cfg["ib"]) if cfg["ib"] else None}
            changed = sorted(k for k in now if last is not None and now[k] != last[k])
            if last is None or changed or wake.is_set():
                why = "start" if last is None else ", ".join(changed + (
                    ["Xid in the kernel log"] if wake.is_set() else []))
                wake.clear()
                log(f"watch: running the host checks ({why})")
                main(["--config", config, "--host-only"])
            last = now
            wake.wait(cfg["watch"]["interval_s"])
    finally:
        for proc in children:
            proc.kill()
            proc.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-restart", action="store_true",
                        help="observe only: never restart, leave the state file alone")
    parser.add_argument("--clear-xid", metavar="PCI",
                        help="after resetting a GPU: forget its fatal Xids (PCI address as "
                             "the check names it, or all) and exit")
    parser.add_argument("--host-only", action="store_true",
                        help="run the host's checks only (GPUs, Xid, HCAs, cache, the "
                             "gateway's log); the units' results in the metrics stay those "
                             "of the last full run and no unit is restarted")
    parser.add_argument("--watch", action="store_true",
                        help="stay resident: poll what a host fault changes every "
                             "watch.interval_s and run the host's checks when it changes")
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
    if args.clear_xid:
        return clear_xid(cfg, args.clear_xid, log)
    if args.watch:
        return watch(args.config, cfg, log)

    started = time.monotonic()
    results = []
    state_path = cfg["state_file"]
    budget = max([u["health_timeout_s"] + u["generate_timeout_s"] for u in cfg["units"]] +
                 [4 * cfg["gpu"]["timeout_s"] + 20]) + 10  # amd-smi: 4 commands
    lock = None
    if not args.no_restart:  # one run at a time changes the state (cursor, streaks)
        wait = budget if cfg["lock_wait_s"] is None else cfg["lock_wait_s"]
        lock, why = take_lock(state_path + ".lock", wait)
        if why:
            log(f"ERROR state  - {why}")
            results.append(result("state", "", ERROR, why, started))
    state = load_state(state_path, log)
    lost = "updated" not in state  # none written yet, or lost: systemd still knows
    started = time.monotonic()  # the checks' own budget starts once the lock is held
    statuses = {u["unit"]: safe_unit_status(u["unit"]) for u in cfg["units"]}
    host_out = {}
    jobs = []
    for unit in [] if args.host_only else cfg["units"]:
        out = []
        jobs.append((unit, out, threading.Thread(
            target=check_unit, args=(unit, statuses[unit["unit"]], out), daemon=True)))
    jobs_of_host = host_jobs(cfg, state, host_out)
    host_thread = threading.Thread(target=host_checks, args=(jobs_of_host, host_out),
                                   daemon=True)
    for _, _, thread in jobs:
        thread.start()
    host_thread.start()
    deadline = started + budget

    def no_result(check, unit, thread):
        """Every configured check has a result: a unit's still running past the budget
        fails (its engine does not answer), a host check's is the checker's own trouble (a
        tool that hangs: an error, never a drain); one whose thread ended without a result
        is an error."""
        if thread.is_alive():
            return result(check, unit, FAIL if unit else ERROR,
                          f"did not finish within {budget}s", started)
        return result(check, unit, ERROR, "gave no result (its thread ended early)", started)

    for unit, out, thread in jobs:
        thread.join(max(0.0, deadline - time.monotonic()))
        got = list(out)
        done = {r["check"] for r in got}
        results.extend(got + [no_result(c, unit["unit"], thread) for c in unit_checks(unit)
                              if c not in done])
    host_thread.join(max(0.0, deadline - time.monotonic()))
    extras = {}
    for name, checks, _ in jobs_of_host:
        if name in host_out:
            found, extras[name] = host_out[name]
            results.extend(found)
        else:
            results.extend(no_result(c, "", host_thread) for c in checks)
    gpu = extras.get("nvidia") or extras.get("amd") or {}
    xids, free = extras.get("gpu_xid"), extras.get("cache")
    ib = extras.get("ib") or []
    if args.host_only:  # the units as the last full run found them
        logged = list(results)
        results = state.get("unit_results", []) + results
    else:
        logged = results
        state["unit_results"] = [r for r in results if r["unit"]]

    for r in logged:
        log("{:<4} {:<10} {} {:.3f}s {}".format(r["status"].upper(), r["check"],
                                               r["unit"] or "-", r["duration_s"], r["detail"]))

    failed = {r["unit"] for r in results if r["status"] == FAIL and r["unit"]}
    errored = {r["unit"] for r in results if r["status"] == ERROR and r["unit"]} - failed
    # observing only: the streaks a run would count, on a copy (the metrics show the saved)
    held = host_faults(results)
    deploying = deploy_holder(cfg["deploy_lock"])
    if deploying:  # its rolling restarts and ours must not cross
        log(f"INFO deploy   - {deploying} is deploying to this host ({cfg['deploy_lock']}): "
            "no restart, no drain until it ends")
    decisions = {} if args.host_only else decide_restarts(
        cfg, statuses, failed, state if lock else json.loads(json.dumps(state)), log,
        act=lock is not None and not deploying, errored=errored, held=held)
    if lock is not None and not deploying:
        drain(cfg, state, statuses, held, log, lost=lost)
    if held:  # fab status reads it: the host is sick since the first run that saw it
        since = (state.get("host_fault") or {}).get("since") or time.time()
        state["host_fault"] = {"checks": held, "since": since}
    else:
        state.pop("host_fault", None)
    if lock is not None:
        try:
            state["updated"] = time.time()
            atomic_write(state_path, json.dumps(state, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            log(f"FAIL state   - state file {state_path}: {exc}")
            results.append(result("state", "", FAIL, f"{state_path}: {exc}", started))
    for name, text in decisions.items():
        log(f"INFO restart  {name} {text}")
    if held:
        log("INFO host     - restarts held while {} fails{}: fix what the check names".format(
            ", ".join(held), "; engines stopped (drained): " + ", ".join(state["drained"])
            if state.get("drained") else ""))

    healthy = all(r["status"] in (OK, NA) for r in results)
    took = time.monotonic() - started
    try:
        atomic_write(cfg["textfile"], metrics(cfg, results, statuses, state, gpu, xids,
                                              free, ib, time.time(), round(took, 4), held))
    except OSError as exc:
        log("FAIL metrics - {}: {}".format(cfg["textfile"], exc))
        healthy = False
    if lock is not None:  # held until the metrics are written: an older run never wins
        lock.close()
    code = 0 if healthy else 1
    log("{}: {} in {:.2f}s".format(cfg["host"], "healthy" if healthy else "UNHEALTHY", took))
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
                          "timestamp": time.time(), "checks": results, "units": units,
                          "host_fault": held, "drained": state.get("drained") or [],
                          "deploying": deploying},
                         indent=1, sort_keys=True))
    return code


if __name__ == "__main__":
    sys.exit(main())

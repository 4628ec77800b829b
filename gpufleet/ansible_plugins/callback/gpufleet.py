"""gpufleet's stdout callback: Ansible's default output, plus the progress of long work.

A task that sets the variable ``gpufleet_progress: true`` and polls with ``until`` (the
cache role's checkpoint download, the engine runtime's venv install and image pull)
reports through its retries: each retry's stdout is the JSON line ``cache_fetch.py
--status`` (or ``fetch_progress.py --status``) prints, shown as bytes (or files), rate and
ETA instead of "FAILED - RETRYING". On a terminal it is one bar redrawn in place;
otherwise (a log, CI) a plain line when a download starts, then at most one every 10
seconds per host. Under
ansible-runner (AWX, AAP), which wraps this callback in its own (`awx_display`) and runs the
plays on a pseudo-terminal whose output becomes the job's log, the lines are plain too.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ansible.plugins.callback.default import CallbackModule as Default

DOCUMENTATION = """
    name: gpufleet
    type: stdout
    short_description: default output, with progress lines for long downloads
    description:
      - Ansible's default stdout callback; a task with the variable gpufleet_progress set
        shows its retries as progress (bytes, rate, ETA) instead of "FAILED - RETRYING".
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout callback in ansible.cfg
"""

PLAIN_EVERY_S = 10.0
BAR = 24


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(secs) -> str:
    if secs is None:
        return "?"
    secs = int(secs)
    if secs >= 3600:
        return f"{secs // 3600} h {secs % 3600 // 60:02d} m"
    if secs >= 60:
        return f"{secs // 60} m {secs % 60:02d} s"
    return f"{secs} s"


def progress_line(host: str, status: dict) -> tuple[str, float | None]:
    """One line for a --status JSON, and the fraction done (None before any total): by
    bytes for a download that has a byte total (a checkpoint, once resolved; an image's
    layers, fetch_progress.py --pull), by files for one that has none (a venv's lock,
    fetch_progress.py --lock). `unit` names what is counted (files unless said)."""
    total, done = status.get("bytes_total") or 0, status.get("bytes_done") or 0
    files, files_done = status.get("files") or 0, status.get("files_done") or 0
    name, unit = status.get("repo", "download"), status.get("unit", "files")
    by_files = "bytes_total" not in status and files
    if status.get("state") in (None, "starting") or not (total or by_files):
        return f"{host}: {name}: starting", None
    if by_files:
        if status.get("state") == "installing":
            return f"{host}: {name}: {files} {unit} fetched, installing", 1.0
        frac = min(1.0, files_done / files)
        return (f"{host}: {name}: {frac:6.1%} {files_done}/{files} {unit}, {_size(done)} "
                f"fetched, {_size(status.get('rate_bytes_s') or 0)}/s, "
                f"{_duration(status.get('eta_s'))} left"), frac
    frac = min(1.0, done / total)
    return (f"{host}: {name}: {frac:6.1%} {_size(done)} of {_size(total)}, "
            f"{_size(status.get('rate_bytes_s') or 0)}/s, {_duration(status.get('eta_s'))} left, "
            f"{files_done}/{files} {unit}"), frac


class CallbackModule(Default):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "gpufleet"

    def __init__(self):
        super().__init__()
        self._bar_open = False
        self._last_plain: dict[str, float] = {}

    @staticmethod
    def _is_progress(result) -> bool:
        return bool((result.task.vars or {}).get("gpufleet_progress"))

    def _end_bar(self):
        if self._bar_open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self._bar_open = False

    def v2_runner_retry(self, result):
        if not self._is_progress(result):
            self._end_bar()
            return super().v2_runner_retry(result)
        try:
            status = json.loads(result.result.get("stdout") or "{}")
        except ValueError:
            status = {}
        host = self.host_label(result)
        line, frac = progress_line(host, status)
        if sys.stdout.isatty() and os.environ.get("ANSIBLE_STDOUT_CALLBACK") != "awx_display":
            filled = int(BAR * (frac or 0))
            sys.stdout.write(f"\r\x1b[K[{'#' * filled}{'.' * (BAR - filled)}] {line}")
            sys.stdout.flush()
            self._bar_open = True
            return None
        # a line when the download starts, then at most one every PLAIN_EVERY_S per host
        now, last = time.monotonic(), self._last_plain.get(host)
        if frac is None and last is None:
            self._last_plain[host] = -PLAIN_EVERY_S  # the first figures come out at once
        elif frac is None or (last is not None and now - last < PLAIN_EVERY_S):
            return None
        else:
            self._last_plain[host] = now
        self._display.display(f"progress: {line}")
        return None

    def v2_runner_on_ok(self, result):
        self._end_bar()
        return super().v2_runner_on_ok(result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._end_bar()
        return super().v2_runner_on_failed(result, ignore_errors=ignore_errors)

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._end_bar()
        return super().v2_playbook_on_task_start(task, is_conditional)

#!/usr/bin/env python3
"""Run pip on a lock and keep its progress in a status file, for the engine runtime role.

    pip_progress.py --status-file F --lock LOCK --name NAME -- python -m pip install -r LOCK ...
    pip_progress.py --status F

The first form runs the command (pip's output passes through to this program's stdout,
merged with its stderr, and the exit code is pip's) and rewrites F (JSON, atomically) at
most every --interval seconds and at the end: the state (running, installing, done,
failed), the lock's file count and how many of its wheels pip has fetched, the bytes of the
fetched wheels (from pip's `Downloading NAME.whl (SIZE)` lines; a wheel pip has cached or
reads from a directory counts with no bytes), the rate and the time left. A lock has no
sizes, so the fraction and the time left go by files. pip resolves first (a `Collecting`
line and the wheel's metadata for each requirement) and fetches the wheels after, so only
the wheels' own lines count. The second form prints F as one
JSON line; a running install whose process is gone (killed, or the host rebooted) is
`gone`. Standard library only; Python 3.8 or newer.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

UNITS = {"B": 1, "bytes": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 1024,
         "MiB": 1024 ** 2, "GiB": 1024 ** 3}
# a wheel fetched: over the network (its size), from pip's cache or a local directory
DOWNLOADING = re.compile(r"^\s*Downloading (\S+) \(([\d.]+) (\w+)\)")
LOCAL = re.compile(r"^\s*(?:Using cached|Processing) \S+\.whl(?:\s|$)")
INSTALLING = re.compile(r"^Installing collected packages")
REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?\s*==")


def lock_files(path):
    """How many files the lock pins (one requirement line each)."""
    with open(path) as fh:
        return sum(1 for line in fh if REQUIREMENT.match(line))


class Progress:
    def __init__(self, name, files, status_file, interval):
        self.name, self.files, self.path, self.interval = name, files, status_file, interval
        self.t0 = time.monotonic()
        self.started = 0  # wheels pip has begun to fetch
        self.bytes = 0.0  # sizes of the fetched files
        self.pending = 0.0  # the file being fetched now
        self.state = "running"
        self.written = 0.0

    def line(self, text):
        """Take one line of pip's output; True when the status changed."""
        fetched = DOWNLOADING.match(text)
        if fetched and fetched.group(1).endswith(".metadata"):
            return False  # the resolution's look at a wheel, not the wheel
        if fetched or LOCAL.match(text):
            self.started += 1
            self.bytes += self.pending
            self.pending = float(fetched.group(2)) * UNITS.get(fetched.group(3), 1) \
                if fetched else 0.0
        elif INSTALLING.match(text):
            self.bytes += self.pending
            self.pending = 0.0
            self.started = max(self.started, self.files)
            self.state = "installing"
        else:
            return False
        return True

    def status(self):
        secs = max(time.monotonic() - self.t0, 1e-6)
        done = self.files if self.state in ("installing", "done") else max(self.started - 1, 0)
        done = min(done, self.files)
        rate = self.bytes / secs
        eta = None
        if self.state == "running" and 0 < done < self.files:
            eta = round(secs / done * (self.files - done))
        return {"pid": os.getpid(), "host": socket.gethostname(), "repo": self.name,
                "state": self.state, "files_done": done, "files": self.files,
                "bytes_done": round(self.bytes), "rate_bytes_s": round(rate), "eta_s": eta,
                "seconds": round(secs, 1)}

    def write(self, force=False):
        now = time.monotonic()
        if not force and now - self.written < self.interval:
            return
        self.written = now
        data = json.dumps(self.status()) + "\n"
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".progress-")
            with os.fdopen(fd, "w") as fh:
                fh.write(data)
            os.replace(tmp, self.path)
        except OSError:
            pass  # the progress is for the operator's eyes; the install goes on


def run(args):
    progress = Progress(args.name, lock_files(args.lock), args.status_file, args.interval)
    progress.write(force=True)
    proc = subprocess.Popen(args.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    for text in proc.stdout:
        sys.stdout.write(text)
        if progress.line(text.rstrip("\n")):
            progress.write()
    rc = proc.wait()
    progress.state = "done" if rc == 0 else "failed"
    progress.write(force=True)
    sys.stdout.flush()
    return rc


def show(path):
    try:
        with open(path) as fh:
            line = json.loads(fh.read())
    except (OSError, ValueError):
        line = {"state": "starting"}  # not written yet
    if line.get("state") in ("running", "installing") and \
            line.get("host") == socket.gethostname():
        try:
            os.kill(int(line["pid"]), 0)
        except ProcessLookupError:
            line["state"] = "gone"
        except (OSError, KeyError, ValueError):
            pass
    print(json.dumps(line))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--status", metavar="STATUS_FILE", help="print the status file and end")
    p.add_argument("--status-file", help="where the progress goes (JSON)")
    p.add_argument("--lock", help="the lock pip installs (its files are counted)")
    p.add_argument("--name", default="venv", help="what is installed, for the progress line")
    p.add_argument("--interval", type=float, default=2.0,
                   help="seconds between status writes")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the pip command")
    args = p.parse_args(argv)
    if args.status:
        return show(args.status)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not (args.status_file and args.lock and args.command):
        p.error("--status-file, --lock and -- COMMAND are required (or --status)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Run a long fetch (pip on a lock, podman pulling an image) and keep its progress in a
status file, for the engine runtime role.

    fetch_progress.py --status-file F --name NAME --lock LOCK -- python -m pip install -r LOCK ...
    fetch_progress.py --status-file F --name NAME --pull -- podman pull REFERENCE
    fetch_progress.py --status F

The first two forms run the command and rewrite F (JSON, atomically) at most every
--interval seconds and at the end: the state (running, installing, done, failed), how much
is fetched, the rate and the time left; the command's output passes through to this
program's stdout (merged with its stderr) and the exit code is the command's.

- pip (--lock): the lock's file count and how many of its wheels pip has fetched, the bytes
  of the fetched wheels (pip's `Downloading NAME.whl (SIZE)` lines; a wheel pip has cached
  or reads from a directory counts with no bytes). A lock has no sizes, so the fraction and
  the time left go by files. pip resolves first (a `Collecting` line and the wheel's
  metadata for each requirement) and fetches the wheels after: only the wheels' own lines
  count.
- podman (--pull): podman draws its per-layer progress bars only on a terminal, so it runs
  on a pseudo-terminal here, and the bars (`Copying blob 30babffc8f09 [==>--] 12.3MiB /
  145.1MiB`, then `... done` or `... skipped: already exists`) give each layer's bytes and
  size; the output passed on is podman's lines without the bars, one line per layer when
  it is done. The total is the layers podman has started (it fetches a few at a time), so
  it can grow while the pull goes on.

The third form prints F as one JSON line; a running fetch whose process is gone (killed,
or the host rebooted) is `gone`. Standard library only; Python 3.8 or newer.
"""

import argparse
import errno
import fcntl
import json
import os
import pty
import re
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time

UNITS = {"b": 1, "B": 1, "bytes": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9,
         "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}
# pip: a wheel fetched: over the network (its size), from pip's cache or a local directory
DOWNLOADING = re.compile(r"^\s*Downloading (\S+) \(([\d.]+) (\w+)\)")
LOCAL = re.compile(r"^\s*(?:Using cached|Processing) \S+\.whl(?:\s|$)")
INSTALLING = re.compile(r"^Installing collected packages")
REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?\s*==")
# podman: a layer's bar (containers/image: the digest cut to 12 characters on a terminal,
# whole off one), its counters, its end
BLOB = re.compile(r"Copying blob (?:sha256:)?([0-9a-f]{6,})\s*(.*)$")
COUNTERS = re.compile(r"([\d.]+)\s*([KMGT]?i?B|b)\s*/\s*([\d.]+)\s*([KMGT]?i?B|b)")
# what a terminal is sent besides text: colours, cursor moves, line clears
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


def size(number, unit):
    return float(number) * UNITS.get(unit, 1)


def lock_files(path):
    """How many files the lock pins (one requirement line each)."""
    with open(path) as fh:
        return sum(1 for line in fh if REQUIREMENT.match(line))


class Progress:
    """The status file: what every fetch keeps (subclasses count what is fetched)."""

    unit = "files"

    def __init__(self, name, status_file, interval):
        self.name, self.path, self.interval = name, status_file, interval
        self.t0 = time.monotonic()
        self.state = "running"
        self.written = 0.0

    def counts(self):
        """(files done, files, bytes done, bytes total or None)."""
        raise NotImplementedError

    def status(self):
        secs = max(time.monotonic() - self.t0, 1e-6)
        done, files, got, total = self.counts()
        rate = got / secs
        eta = None
        if self.state == "running":
            if total and rate > 0 and got < total:
                eta = round((total - got) / rate)
            elif total is None and 0 < done < files:
                eta = round(secs / done * (files - done))
        line = {"pid": os.getpid(), "host": socket.gethostname(), "repo": self.name,
                "state": self.state, "unit": self.unit, "files_done": done, "files": files,
                "bytes_done": round(got), "rate_bytes_s": round(rate), "eta_s": eta,
                "seconds": round(secs, 1)}
        if total is not None:
            line["bytes_total"] = round(total)
        return line

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
            pass  # the progress is for the operator's eyes; the fetch goes on


class PipProgress(Progress):
    def __init__(self, name, status_file, interval, files):
        super().__init__(name, status_file, interval)
        self.files = files
        self.started = 0  # wheels pip has begun to fetch
        self.bytes = 0.0  # sizes of the fetched files
        self.pending = 0.0  # the file being fetched now

    def line(self, text):
        """Take one line of pip's output: what to pass on, and whether the status changed."""
        fetched = DOWNLOADING.match(text)
        if fetched and fetched.group(1).endswith(".metadata"):
            return text, False  # the resolution's look at a wheel, not the wheel
        if fetched or LOCAL.match(text):
            self.started += 1
            self.bytes += self.pending
            self.pending = size(fetched.group(2), fetched.group(3)) if fetched else 0.0
        elif INSTALLING.match(text):
            self.bytes += self.pending
            self.pending = 0.0
            self.started = max(self.started, self.files)
            self.state = "installing"
        else:
            return text, False
        return text, True

    def counts(self):
        done = self.files if self.state in ("installing", "done") else max(self.started - 1, 0)
        return min(done, self.files), self.files, self.bytes, None


class PullProgress(Progress):
    unit = "layers"

    def __init__(self, name, status_file, interval):
        super().__init__(name, status_file, interval)
        self.layers = {}  # short digest -> [bytes done, size, "running"|"done"|"skipped"]
        self.config = ""  # the config's bar, as last drawn

    def line(self, text):
        """Take one line of podman's terminal output (escapes removed): what to pass on
        (None for a bar's redraw), and whether the status changed."""
        blob = BLOB.search(text)
        if not blob:
            if text.startswith("Copying config"):  # a bar too, redrawn until the end
                said, self.config = self.config, text.strip()
                return (self.config if self.config.endswith("done") and said != self.config
                        else None), False
            return text, False
        digest, rest = blob.group(1)[:12], blob.group(2).strip()
        new = digest not in self.layers
        layer = self.layers.setdefault(digest, [0.0, 0.0, "running"])
        was = list(layer)
        counters = COUNTERS.search(rest)
        if rest.startswith("skipped"):
            layer[2] = "skipped"
        elif rest.startswith("done"):
            layer[0], layer[2] = layer[1], "done"
        elif counters and layer[2] == "running":
            layer[0] = size(counters.group(1), counters.group(2))
            layer[1] = size(counters.group(3), counters.group(4))
        if layer[2] != was[2]:  # its end: "done", "skipped: already exists"
            return f"Copying blob {digest} {rest}", True
        if new:
            return f"Copying blob {digest}", True
        return None, layer != was

    def counts(self):
        fetched = [layer for layer in self.layers.values() if layer[2] != "skipped"]
        done = sum(1 for layer in self.layers.values() if layer[2] != "running")
        return (done, len(self.layers), sum(layer[0] for layer in fetched),
                sum(layer[1] for layer in fetched) if fetched else None)


def lines_of_pipe(proc):
    for text in proc.stdout:
        yield text.rstrip("\n")


def lines_of_terminal(master):
    """The text lines a program wrote to its terminal, as a screen would show each line
    when it is redrawn: escapes removed, split at carriage returns and newlines."""
    pending = ""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError as err:
            if err.errno != errno.EIO:  # EIO: the program closed its terminal
                raise
            data = b""
        if not data:
            break
        parts = re.split(r"[\r\n]", pending + ESCAPES.sub("", data.decode("utf-8", "replace")))
        pending = parts.pop()
        yield from parts
    if pending:
        yield pending


def start(command, pull):
    """The command, on a pseudo-terminal for a pull (podman draws its bars only there)."""
    if not pull:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, bufsize=1)
        return proc, lines_of_pipe(proc)
    master, slave = pty.openpty()
    # rows, columns: wide enough that no bar is cut
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(command, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, TERM="xterm"))
    os.close(slave)
    return proc, lines_of_terminal(master)


def run(args, progress):
    progress.write(force=True)
    proc, lines = start(args.command, args.pull)
    for text in lines:
        passed, changed = progress.line(text)
        if passed is not None and (passed or not args.pull):
            sys.stdout.write(passed + "\n")
            sys.stdout.flush()
        if changed:
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
    p.add_argument("--lock", help="pip installs this lock (its files are counted)")
    p.add_argument("--pull", action="store_true",
                   help="the command is a podman pull (its layers' bytes are counted)")
    p.add_argument("--name", default="fetch", help="what is fetched, for the progress line")
    p.add_argument("--interval", type=float, default=2.0,
                   help="seconds between status writes")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command")
    args = p.parse_args(argv)
    if args.status:
        return show(args.status)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not (args.status_file and args.command and bool(args.lock) != args.pull):
        p.error("--status-file, one of --lock or --pull, and -- COMMAND are required "
                "(or --status)")
    if args.pull:
        progress = PullProgress(args.name, args.status_file, args.interval)
    else:
        progress = PipProgress(args.name, args.status_file, args.interval,
                               lock_files(args.lock))
    return run(args, progress)


if __name__ == "__main__":
    sys.exit(main())

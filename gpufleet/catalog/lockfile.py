"""Engine environment locks (catalog/locks/*.txt): reading them and checking them
against the package index. scripts/lock writes them; tests/unit/test_locks.py checks them.

A lock is pip's requirements format with hashes. Its header comment lines `# KEY: VALUE`
say what it was made from: engine, arch, python, platform, index, glibc (the newest
manylinux glibc among its wheels, i.e. the host's floor), requirement (one line per
top-level requirement), excluded (one line per package left out, with why).
"""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from packaging import tags
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[2]
_HEADER = re.compile(r"^# ([a-z-]+): (.*)$")
_PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_|^manylinux(2014|2010|1)_")
_LEGACY = {"2014": (2, 17), "2010": (2, 12), "1": (2, 5)}


@dataclass
class Lock:
    path: Path | None
    header: dict[str, list[str]] = field(default_factory=dict)  # key -> values, in order
    pins: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # name -> (ver, hashes)

    def one(self, key: str) -> str:
        return self.header[key][0]


def read(path: Path) -> Lock:
    return parse(path.read_text(), path)


def parse(text: str, path: Path | None = None) -> Lock:
    lock = Lock(path=path)
    name = None
    for line in text.splitlines():
        if m := _HEADER.match(line):
            lock.header.setdefault(m.group(1), []).append(m.group(2))
            continue
        if m := _PIN.match(line):
            name = str(canonicalize_name(m.group(1)))
            lock.pins[name] = (m.group(2), [])
        if name and not line.startswith("#"):
            lock.pins[name][1].extend(_HASH.findall(line))
    return lock


def index_files(index: str, names: set[str], workers: int = 16) -> dict[str, list[dict]]:
    """name -> the index's files of that project (PEP 691 JSON: filename, hashes, ...),
    one request per name, in parallel. A project the index lacks maps to []."""

    def fetch(name: str) -> tuple[str, list[dict]]:
        req = urllib.request.Request(
            f"{index.rstrip('/')}/{name}/",
            headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        for attempt in range(3):  # a dropped connection is retried, a 404 is an answer
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return name, json.load(resp)["files"]
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return name, []
                if attempt == 2 or exc.code < 500:
                    raise
            except (urllib.error.URLError, OSError):
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(fetch, sorted(names)))


def version_of(filename: str) -> str | None:
    """The version a wheel's file name carries (None for an sdist)."""
    if not filename.endswith(".whl"):
        return None
    return str(parse_wheel_filename(filename)[1])


def fits(filename: str, python: str, arch: str) -> bool:
    """Whether a wheel installs on CPython `python` (e.g. "3.12") on Linux/glibc `arch`
    (at any manylinux level: glibc_of says which)."""
    if not filename.endswith(".whl"):
        return False
    return not _supported(python, arch).isdisjoint(parse_wheel_filename(filename)[3])


@cache
def _supported(python: str, arch: str) -> frozenset:
    version = tuple(int(x) for x in python.split("."))
    platforms = [f"manylinux_2_{minor}_{arch}" for minor in range(60, 4, -1)]
    platforms += [f"manylinux{legacy}_{arch}" for legacy in ("2014", "2010", "1")]
    return frozenset([*tags.cpython_tags(version, platforms=platforms),
                      *tags.compatible_tags(version, platforms=platforms)])


def glibc_of(filename: str) -> tuple[int, int]:
    """The lowest glibc a wheel's manylinux tags ask for ((0, 0) for a pure wheel)."""
    found = []
    for tag in parse_wheel_filename(filename)[3]:
        if m := _MANYLINUX.match(tag.platform):
            found.append(_LEGACY[m.group(3)] if m.group(3) else (int(m.group(1)), int(m.group(2))))
    return min(found, default=(0, 0))

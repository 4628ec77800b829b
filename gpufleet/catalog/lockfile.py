"""Engine environment locks (catalog/locks/*.txt): reading them and checking them
against the package index. scripts/lock writes them; tests/unit/test_locks.py checks them.

A lock is pip's requirements format with hashes. Its header comment lines `# KEY: VALUE`
say what it was made from: engine, arch, python, platform, index, glibc (the newest
manylinux glibc among its wheels, i.e. the host's floor), requirement (one line per
top-level requirement), excluded (one line per package left out, with why), find-links
(the page an engine's pins the index lacks come from, engines.yml lock_find_links).
"""

from __future__ import annotations

import email.parser
import hashlib
import html.parser
import io
import json
import re
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from packaging import tags
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

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


class _Anchors(html.parser.HTMLParser):
    """The href of each <a> of a page."""

    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def page_files(page: str, url: str) -> list[dict]:
    """The wheels a find-links page (pip's and uv's --find-links URL, a PEP 503 page) links
    to with a sha256 (`...whl#sha256=HEX`), as index_files gives files: filename, url
    (relative hrefs resolved against the page's URL), hashes."""
    parser = _Anchors()
    parser.feed(page)
    found = []
    for href in parser.hrefs:
        target, fragment = urllib.parse.urldefrag(urllib.parse.urljoin(url, href))
        filename = urllib.parse.unquote(urllib.parse.urlsplit(target).path.rsplit("/", 1)[-1])
        algo, _, digest = fragment.partition("=")
        if filename.endswith(".whl") and algo == "sha256" and digest:
            found.append({"filename": filename, "url": target, "hashes": {"sha256": digest}})
    return found


def dir_files(directory: Path) -> list[dict]:
    """The wheels of a local find-links directory, as index_files gives files: filename,
    url (file://), hashes (sha256, computed)."""
    found = []
    for path in sorted(Path(directory).glob("*.whl")):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        found.append({"filename": path.name, "url": path.resolve().as_uri(),
                      "hashes": {"sha256": digest.hexdigest()}})
    return found


def find_links_files(where: str) -> dict[str, list[dict]]:
    """name -> the wheels of a find-links source, a local directory or an http(s) page,
    as index_files gives them (merge_files adds them to the index's)."""
    if where.startswith(("http://", "https://")):
        with urllib.request.urlopen(where, timeout=60) as resp:
            found = page_files(resp.read().decode(resp.headers.get_content_charset() or "utf-8"),
                               resp.geturl())
    else:
        found = dir_files(Path(where))
    by_name: dict[str, list[dict]] = {}
    for f in found:
        by_name.setdefault(str(canonicalize_name(parse_wheel_filename(f["filename"])[0])),
                           []).append(f)
    return by_name


def merge_files(*sources: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """index_files-like maps merged per name; a file (by sha256) listed twice is kept once."""
    merged: dict[str, list[dict]] = {}
    for source in sources:
        for name, files in source.items():
            seen = {f["hashes"].get("sha256") for f in merged.get(name, [])}
            merged.setdefault(name, []).extend(
                f for f in files if f["hashes"].get("sha256") not in seen)
    return merged


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


def marker_env(lock: Lock) -> dict[str, str]:
    """The environment markers of the machine a lock is for (Linux, its arch and CPython),
    not of the machine that reads it: a resolver run elsewhere with only a platform tag
    (pip's --platform) evaluates markers for itself and gets another closure."""
    python = lock.one("python")
    return {"python_version": python, "python_full_version": f"{python}.0",
            "implementation_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "platform_machine": lock.one("arch"),
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_release": "", "platform_version": ""}


def closure(lock: Lock, requires: dict[str, list[str]]) -> dict[str, list[str]]:
    """What resolving the lock's top-level requirements with their dependencies, for the
    lock's platform and Python (marker_env), finds that the lock does not hold.
    `requires`: each pinned name -> its pinned version's Requires-Dist. Returns
    {missing: required but not pinned, mismatched: pinned at a version its requirer does
    not take, unreached: pinned but required by nothing}; the lock's `excluded` packages
    are left out on purpose."""
    env = marker_env(lock)
    excluded = {str(canonicalize_name(line.split("==")[0].split()[0]))
                for line in lock.header.get("excluded", [])}
    done: dict[str, set[str]] = {}  # name -> the extras whose requirements were followed
    found: dict[str, list[str]] = {"missing": [], "mismatched": [], "unreached": []}
    todo = [(r, "the lock's requirements") for r in lock.header.get("requirement", [])]
    while todo:
        line, by = todo.pop()
        req = Requirement(line)
        name = str(canonicalize_name(req.name))
        if name in excluded:
            continue
        if name not in lock.pins:
            found["missing"].append(f"{name} ({by}: {line})")
            continue
        version = lock.pins[name][0]
        if not req.specifier.contains(version, prereleases=True):
            found["mismatched"].append(f"{name}=={version} ({by}: {line})")
        extras = {""} | set(req.extras)
        if extras <= done.get(name, set()):
            continue
        done.setdefault(name, set()).update(extras)
        for dep in requires.get(name, []):
            marker = Requirement(dep).marker
            if marker is None or any(marker.evaluate({**env, "extra": e}) for e in extras):
                todo.append((dep, f"{name}=={version}"))
    found["unreached"] = sorted(set(lock.pins) - set(done))
    for key in ("missing", "mismatched"):
        found[key] = sorted(set(found[key]))
    return found


class _RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests, one request per read, the last 64 KiB
    fetched at once (a zip's end record and, mostly, its central directory): what
    zipfile needs to read one member of a wheel without the whole wheel."""

    def __init__(self, url: str):
        self.url, self.pos = url, 0
        tail = self._get(-(1 << 16))
        self.size = self._total
        self.tail_at, self.tail = self.size - len(tail), tail

    def _get(self, start: int, end: int | None = None) -> bytes:
        spec = f"bytes={start}" if end is None else f"bytes={start}-{end - 1}"
        req = urllib.request.Request(self.url, headers={"Range": spec})
        with urllib.request.urlopen(req, timeout=60) as resp:
            if resp.status != 206:
                raise OSError(f"{self.url}: no range requests (HTTP {resp.status})")
            self._total = int(resp.headers["Content-Range"].rsplit("/", 1)[1])
            return resp.read()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.pos + n, self.size)
        if end <= self.pos:
            return b""
        if self.pos >= self.tail_at:
            data = self.tail[self.pos - self.tail_at:end - self.tail_at]
        else:
            data = self._get(self.pos, end)
        self.pos += len(data)
        return data


@cache
def wheel_requires(url: str) -> tuple[str, ...]:
    """A wheel's Requires-Dist, read from its METADATA: over range requests, or from the
    file itself for a file:// url (a local find-links directory)."""
    local = url.startswith("file:")
    source = (urllib.request.url2pathname(urllib.parse.urlsplit(url).path) if local
              else _RangeFile(url))
    with zipfile.ZipFile(source) as wheel:
        (name,) = [n for n in wheel.namelist()
                   if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        metadata = email.parser.BytesParser().parsebytes(wheel.read(name))
    return tuple(metadata.get_all("Requires-Dist") or [])


def requires_of(lock: Lock, files: dict[str, list[dict]],
                workers: int = 16) -> dict[str, list[str]]:
    """name -> the Requires-Dist of each pin of the lock, read from the pinned wheel that
    installs on the lock's arch and Python (the index serves no separate metadata), one
    wheel per pin, in parallel. `files`: index_files of the lock's names (merge_files with
    find_links_files for a lock with pins from a find-links source)."""
    python, arch = lock.one("python"), lock.one("arch")

    def fetch(name: str) -> tuple[str, list[str]]:
        version, hashes = lock.pins[name]
        wheel = next(f for f in files.get(name, []) if f["hashes"].get("sha256") in hashes
                     and fits(f["filename"], python, arch))
        for attempt in range(3):
            try:
                return name, list(wheel_requires(wheel["url"]))
            except (urllib.error.URLError, OSError):
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(fetch, sorted(lock.pins)))


# what a new engine release is read for: the kernel, tensor and KV-transfer packages whose
# versions move with it (FlashInfer's floor, torch's CUDA build, NIXL, Mooncake)
WATCHED = ("torch", "flashinfer-python", "flashinfer-cubin", "sglang-kernel", "nixl",
           "nixl-cu12", "nixl-cu13", "mooncake-transfer-engine", "vllm", "ai-dynamo-runtime")


def newer(files: list[dict], version: str, python: str, arch: str) -> list[str]:
    """The final releases above VERSION that have a wheel for CPython PYTHON on ARCH."""
    pinned = Version(version)
    found = {Version(v) for f in files if (v := version_of(f["filename"]))
             and not f.get("yanked") and fits(f["filename"], python, arch)}
    return [str(v) for v in sorted(found) if v > pinned and not v.is_prerelease]


def outdated(lock: Lock, requirements: list[str], files: dict[str, list[dict]],
             read_requires=None) -> list[dict]:
    """For the lock's top-level requirements and its watched pins: each one's pinned
    version, the newer releases the index serves for the lock's arch and Python, and for a
    top-level requirement's newest release, the watched packages it requires (so a pin can
    move with what it needs in one commit). READ_REQUIRES(url) -> Requires-Dist (default:
    wheel_requires, over the network)."""
    read_requires = read_requires or wheel_requires
    python, arch = lock.one("python"), lock.one("arch")
    top = [str(canonicalize_name(Requirement(r).name)) for r in requirements]
    rows = []
    for name in dict.fromkeys([*top, *(n for n in WATCHED if n in lock.pins)]):
        if name not in lock.pins:
            continue
        version = lock.pins[name][0]
        ahead = newer(files.get(name, []), version, python, arch)
        row = {"name": name, "pinned": version, "newer": ahead,
               "via": "requirement" if name in top else "dependency", "needs": []}
        if ahead and name in top:
            wheel = next(f for f in files[name] if version_of(f["filename"]) == ahead[-1]
                         and fits(f["filename"], python, arch))
            env = {**marker_env(lock), "extra": ""}
            for dep in read_requires(wheel["url"]):
                req = Requirement(dep)
                dep_name = str(canonicalize_name(req.name))
                if dep_name in WATCHED and (req.marker is None or req.marker.evaluate(env)):
                    served = any(req.specifier.contains(v) for f in files.get(dep_name, [])
                                 if (v := version_of(f["filename"]))
                                 and fits(f["filename"], python, arch))
                    need = str(req).split(";")[0].strip()
                    row["needs"].append(need if served else f"{need} (not on the index)")
        rows.append(row)
    return rows

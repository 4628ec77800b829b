#!/usr/bin/env python3
"""Put one Hugging Face checkpoint on the shared cache, verified, for offline serving.

Runs on ONE host that mounts the shared cache (NFS/Lustre/GPFS), in a small venv that
holds huggingface_hub. Standard HF cache layout under CACHE_DIR/hub, so engines started
with HF_HUB_OFFLINE=1 and HF_HUB_CACHE=CACHE_DIR/hub find the files.

    cache_fetch.py --repo zai-org/GLM-5.3-Flash --revision main --cache-dir /srv/hf --json

The token comes from the environment (HF_TOKEN) or --token-file, never from argv.

How it works:
- a lock file created with O_CREAT|O_EXCL in CACHE_DIR/hub/.gpufleet-locks/ (works on
  NFS/Lustre/GPFS, unlike flock); the holder rewrites a heartbeat into it; a waiter breaks
  it when the heartbeat has not changed for --lock-stale seconds of its own clock (no
  clock sync needed), or at once when the holder is a dead pid on the same host;
- the revision is resolved to a commit; only the files an engine reads are selected;
  what is missing is summed and compared with the free space before any byte moves;
- each file goes into a private staging directory on the same filesystem, is hashed
  (SHA-256 for LFS files, git blob sha1 otherwise) as its bytes arrive, so verification
  adds no second read, and only then is renamed into blobs/ and linked from
  snapshots/<commit>/: the engine's path never shows a partial or wrong file;
- the bytes: huggingface_hub resolves each file (metadata, redirects, token, gated repos).
  A file the Hub serves through Xet goes through huggingface_hub's Xet client
  (HF_XET_HIGH_PERFORMANCE=1 unless set; --xet-concurrency sets
  HF_XET_FIXED_DOWNLOAD_CONCURRENCY for throttled links). Every other file is moved by
  this script: one streamed GET for a file up to --part-mib, else --part-mib range
  requests, at most --workers at once, written into a preallocated staging file and
  hashed in file order: the file's own thread reads its next part and hashes it as it
  lands, idle connections fetch the following parts into memory (at most 4 parts of a
  file in flight); the token goes only to the host that issued it, never to the CDN a
  file redirects to. A failed request resumes where it stopped; each failure, and a
  file whose hash does not match, takes one of the file's --retries attempts;
- a manifest (.gpufleet-manifest-<commit>.json next to blobs/) records every verified
  file with size and mtime, so a re-run with --verify fast only stats files.

On each serving host, --check-files (read-only, offline: no token, no lock, no Hub, no
third-party module) checks that the host sees the fetched checkpoint: the manifest of
--revision (a commit, or a branch or tag through the ref a complete fetch wrote) is
complete and every file it lists is in the snapshot with its size, readable by every user.
It exits 1 when it found a problem; --json prints {"files": N, "problems": [...]}, only.

    cache_fetch.py --check-files --repo zai-org/GLM-5.3-Flash --revision SHA --cache-dir /srv/hf

--status-file PATH: the fetch rewrites PATH (JSON: state, files, bytes, rate, ETA) every
--progress-interval seconds and at its end; `cache_fetch.py --status PATH` prints it
(state "running", "done", "failed", or "gone" when its process ended without saying so),
which is how the Ansible role shows progress while the fetch runs.

Exit codes: 0 ok, 1 download or verification failed, 2 usage, 3 token refused or missing
for a gated repo, 4 repo or revision not found, 5 endpoint unreachable, 6 not enough
disk space, 7 lock wait timed out.

GPUFLEET_CACHE_FAKE_FREE_BYTES (tests only): pretend the cache filesystem has this many
bytes free, to exercise the disk-space refusal.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import fnmatch
import functools
import glob
import hashlib
import http.client
import io
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_AUTH, EXIT_NOT_FOUND, EXIT_ENDPOINT = 0, 1, 2, 3, 4, 5
EXIT_DISK, EXIT_LOCK = 6, 7
GIB = 1024**3
HASH_CHUNK = 8 * 1024 * 1024
MIB = 1024 * 1024
PART_WINDOW = 4  # parts of one file in flight or waiting for the hash, at most
FAKE_FREE_ENV = "GPUFLEET_CACHE_FAKE_FREE_BYTES"
TOKEN_FIX = "set HF_TOKEN on the controller or gpufleet_hf_token in ansible-vault"
ENDPOINT_FIX = "check HF_ENDPOINT / gpufleet_hf_endpoint"
DEFAULT_ENDPOINT = "https://huggingface.co"
USER_AGENT = "gpufleet-cache-fetch"

# What an engine reads from a checkpoint repo (top-level files only: original/, metal/ and
# other folders hold alternative formats the engines do not load).
DEFAULT_ALLOW = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "hf_quant_config.json",
    "quantization_config.json",
    "*.py",
]


class FetchError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class ShortBody(ConnectionError):
    """The server ended a response before the bytes it promised."""


class RangesIgnored(Exception):
    """A range request got the whole file (200): the server does not serve ranges."""


class LinkRefused(Exception):
    """The host a file redirected to (a CDN) refused its signed link: resolve again."""


# --------------------------------------------------------------------------- output


class Redactor(io.TextIOBase):
    """A text stream that replaces secrets before they reach the real stream."""

    def __init__(self, stream, secrets: list[str]):
        self.stream = stream
        self.secrets = [s for s in secrets if s]

    def write(self, text: str) -> int:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        self.stream.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()


LOG_FILE: list = []  # an open --log-file, for `tail -f` on the host while Ansible waits


def log(msg: str):
    print(f"cache_fetch: {msg}", file=sys.stderr, flush=True)
    for f in LOG_FILE:
        f.write(f"{now_iso()} {msg}\n")
        f.flush()


def read_manifest(path) -> dict:
    """A manifest's JSON object; OSError or ValueError when it cannot be read."""
    with open(path) as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- lock


def _json_or_none(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


class SharedLock:
    """An exclusive lock for a shared filesystem: O_CREAT|O_EXCL on a file with a heartbeat.

    ``stale`` seconds without a heartbeat change (timed on the waiter's own monotonic clock)
    make the lock breakable; a lock of a dead pid on this host is broken at once.
    """

    def __init__(self, path: Path, stale: float = 120.0, timeout: float = 3600.0,
                 poll: float = 1.0):
        self.path = path
        self.stale = stale
        self.timeout = timeout
        self.poll = poll
        self.nonce = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.waited = 0.0

    def _body(self) -> bytes:
        return json.dumps({"host": self.host, "pid": os.getpid(), "nonce": self.nonce,
                           "heartbeat": time.time()}).encode()

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(self._body())
            f.flush()
            os.fsync(f.fileno())
        return True

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def _dead_local_holder(self, raw: bytes) -> bool:
        info = _json_or_none(raw)
        if (not isinstance(info, dict) or info.get("host") != self.host
                or not isinstance(info.get("pid"), int)):
            return False
        try:
            os.kill(info["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _break(self, seen: bytes) -> None:
        """Remove a stale lock, unless it changed; a second lock serialises the breakers."""
        guard = self.path.with_name(self.path.name + ".break")
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with contextlib.suppress(OSError):  # a breaker that died: its guard is old
                if time.time() - guard.stat().st_mtime > self.stale:
                    guard.unlink()
            return
        try:
            os.close(fd)
            if self._read() == seen:
                holder = json.loads(seen or b"{}")
                log(f"breaking stale lock of {holder.get('host')} pid {holder.get('pid')}")
                self.path.unlink()
        finally:
            guard.unlink(missing_ok=True)

    def acquire(self) -> bool:
        """Take the lock; returns True when it had to wait for another holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        last, since, announced = None, start, False
        while not self._try_create():
            raw = self._read()
            now = time.monotonic()
            if raw != last:
                last, since = raw, now
            if raw is not None:
                holder = _json_or_none(raw) if not announced else None
                if isinstance(holder, dict):  # not a lock still being (re)written
                    log(f"waiting for the lock held by {holder.get('host')} pid "
                        f"{holder.get('pid')} ({self.path})")
                    announced = True
                if self._dead_local_holder(raw) or now - since > self.stale:
                    self._break(raw)
                    continue
            if now - start > self.timeout:
                raise FetchError(EXIT_LOCK, f"waited {self.timeout:.0f} s for {self.path}; "
                                 "another fetch is still running (its heartbeat is fresh). "
                                 "Wait for it, or raise --lock-timeout")
            time.sleep(self.poll)
        self.waited = time.monotonic() - start
        self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
        self._thread.start()
        return announced

    def _beat(self):
        interval = max(0.2, self.stale / 6)
        while not self._stop.wait(interval):
            raw = self._read()
            if raw is None or self.nonce.encode() not in raw:
                self.lost.set()
                return
            with contextlib.suppress(OSError), open(self.path, "r+b") as f:
                body = self._body()
                f.write(body)
                f.truncate(len(body))

    def release(self):
        self._stop.set()
        if self._thread:
            self._thread.join()
        raw = self._read()
        if raw is not None and self.nonce.encode() in raw:
            self.path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- files


def new_hash(lfs: bool, size: int):
    """What the Hub names a file by: SHA-256 of the content (LFS) or the git blob sha1."""
    return hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % size)


def hash_file(path: Path, lfs: bool, size: int) -> str:
    """SHA-256 of the content (LFS) or the git blob sha1 (regular files)."""
    h = new_hash(lfs, size)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    return hash_file(path, True, 0)


def pwrite_all(fd: int, data: memoryview, offset: int):
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class StreamHash(threading.Thread):
    """Hash a file while huggingface_hub writes it, so that verifying costs no second
    pass over the bytes. It follows the one ``<etag>.<random>.incomplete`` file the
    download writes in ``blobs`` (``<etag>.incomplete`` before huggingface_hub 1.0),
    reading up to what has been written. ``digest(final)``
    returns the hash only when the file it followed became ``final`` (same inode) and it
    read every byte; otherwise None, and the caller hashes the file itself. Nothing is
    trusted on its word: a digest that does not match is checked again from disk."""

    POLL_S = 0.02

    def __init__(self, blobs: Path, etag: str, lfs: bool, size: int, on_read=None):
        super().__init__(daemon=True)
        self.blobs, self.etag, self.lfs, self.size = blobs, etag, lfs, size
        self.on_read = on_read  # called with each chunk's length as it is hashed (progress)
        self.finished = threading.Event()
        self.ino: int | None = None
        self.read = 0
        self.hexdigest: str | None = None

    def _open(self):
        try:
            etag = glob.escape(self.etag)
            found = sorted(self.blobs.glob(f"{etag}.*.incomplete")) + sorted(
                self.blobs.glob(f"{etag}.incomplete"))
        except OSError:
            return None
        for path in found[:1]:
            with contextlib.suppress(OSError):
                return open(path, "rb")  # noqa: SIM115 - held for the whole transfer
        return None

    def run(self):
        fh = None
        while fh is None:
            fh = self._open()
            if fh is None and self.finished.wait(self.POLL_S):
                return
        with fh:
            self.ino = os.fstat(fh.fileno()).st_ino
            h = new_hash(self.lfs, self.size)
            while True:
                chunk = fh.read(HASH_CHUNK)
                if chunk:
                    h.update(chunk)
                    self.read += len(chunk)
                    if self.on_read:
                        self.on_read(len(chunk))
                elif self.finished.is_set():
                    break  # the writer is done: this empty read was the real end
                else:
                    time.sleep(self.POLL_S)
            self.hexdigest = h.hexdigest()

    def stop(self):
        self.finished.set()
        self.join()

    def digest(self, final: Path) -> str | None:
        self.stop()
        try:
            same = final.stat().st_ino == self.ino
        except OSError:
            return None
        return self.hexdigest if same and self.read == self.size else None


def atomic_write(path: Path, data: bytes):
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_symlink(target: str, link: Path):
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}.lnk")
    os.symlink(target, tmp)
    os.replace(tmp, link)


def suffix(share_name: str) -> str:
    """What a share adds to the names of its lock and manifest."""
    return f".{share_name}" if share_name else ""


def share_of(files: list[dict], index: int, count: int) -> list[dict]:
    """Share ``index`` (1-based) of ``count``: the files go, largest first, to the share
    with the fewest bytes so far; every fetcher computes the same split from the listing."""
    load = [0] * count
    mine = []
    for f in sorted(files, key=lambda f: (-f["size"], f["path"])):
        i = load.index(min(load))
        load[i] += f["size"]
        if i == index - 1:
            mine.append(f)
    return mine


def opener(source_address: str | None) -> urllib.request.OpenerDirector:
    """urllib's opener (proxies from the environment, redirects), its connections bound to
    ``source_address`` when given (a host on several networks: the one facing the mirror)."""
    if not source_address:
        return urllib.request.build_opener()
    bind = {"source_address": (source_address, 0)}

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(functools.partial(http.client.HTTPConnection, **bind), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(functools.partial(http.client.HTTPSConnection, **bind), req,
                                context=self._context)

    return urllib.request.build_opener(HTTP, HTTPS)


def select(files: list[dict], allow: list[str] | None) -> list[dict]:
    if allow:
        return [f for f in files if any(fnmatch.fnmatch(f["path"], p) for p in allow)]
    return [f for f in files if "/" not in f["path"]
            and any(fnmatch.fnmatch(f["path"], p) for p in DEFAULT_ALLOW)]


# --------------------------------------------------------------------------- hub errors


def classify(exc: BaseException, args, token: str | None) -> FetchError:
    """Turn a huggingface_hub / transport exception into an exit code and a fix."""
    from huggingface_hub import errors

    repo, rev, endpoint = args.repo, args.revision, args.endpoint
    status = http_status(exc)
    if isinstance(exc, errors.GatedRepoError):
        if not token:
            return FetchError(EXIT_AUTH, f"{repo} is gated and no token was given: {TOKEN_FIX}")
        return FetchError(EXIT_AUTH, f"the token has no access to the gated repo {repo} "
                          f"(HTTP {status}): request access for the token's account on the Hub, "
                          f"or {TOKEN_FIX} to a token that has it")
    if status == 401 and token:
        return FetchError(EXIT_AUTH, f"{endpoint} refused the token (HTTP 401, invalid "
                          f"credentials): {TOKEN_FIX} to a valid token")
    if isinstance(exc, errors.RevisionNotFoundError):
        return FetchError(EXIT_NOT_FOUND, f"revision {rev!r} not found in {repo} on {endpoint}: "
                          "fix gpufleet_model_revision (a branch, tag or commit id of the repo)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        hint = "" if token else f" (if it is private: {TOKEN_FIX})"
        return FetchError(EXIT_NOT_FOUND, f"repo {repo} not found on {endpoint}{hint}: "
                          f"check the model repo id, or {ENDPOINT_FIX}")
    if _file_not_found(exc, errors):
        return FetchError(EXIT_NOT_FOUND, f"a file of {repo}@{rev} vanished on {endpoint}: "
                          f"{type(exc).__name__}")
    if _transport_error(exc):
        return FetchError(EXIT_ENDPOINT, f"cannot reach {endpoint} ({type(exc).__name__}: "
                          f"{_first_line(exc)}): {ENDPOINT_FIX}")
    if isinstance(exc, (errors.HfHubHTTPError, urllib.error.HTTPError)):
        return FetchError(EXIT_FAILED, f"{endpoint} answered HTTP {status}: {_first_line(exc)}")
    return FetchError(EXIT_FAILED, f"{type(exc).__name__}: {_first_line(exc)}")


def _file_not_found(exc: BaseException, errors) -> bool:
    """The Hub answered 404 for a file: RemoteEntryNotFoundError in huggingface_hub >= 1.0;
    in 0.x (the release Python 3.8/3.9 hosts get) EntryNotFoundError, whose subclass
    LocalEntryNotFoundError means the Hub could not be reached, not a missing file."""
    remote = getattr(errors, "RemoteEntryNotFoundError", None)
    if remote is not None:
        return isinstance(exc, remote)
    return isinstance(exc, errors.EntryNotFoundError) and not isinstance(
        exc, errors.LocalEntryNotFoundError)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _transport_error(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 5:
        mod = type(exc).__module__ or ""
        name = type(exc).__name__
        # httpx (huggingface_hub >= 1.0) or requests/urllib3 (0.x); not an HTTP status error
        transport = mod.startswith(("httpx", "httpcore", "requests", "urllib3"))
        if transport and "Error" in name and "Status" not in name and name != "HTTPError":
            return True
        if isinstance(exc, (ConnectionError, socket.gaierror, TimeoutError)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def retryable(exc: BaseException) -> bool:
    from huggingface_hub import errors

    if _file_not_found(exc, errors) or isinstance(
            exc, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, FetchError)):
        return False
    return http_status(exc) not in (401, 403, 404)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a huggingface_hub error or of urllib's HTTPError."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code
    return getattr(getattr(exc, "response", None), "status_code", None)


# --------------------------------------------------------------------------- the fetch


class Budget:
    """A file's attempts: every failed request and every failed verification of the file
    takes one (--retries in all), with a doubling pause (--backoff, at most 60 s)."""

    def __init__(self, path: str, args, lock: SharedLock):
        self.path, self.args, self.lock = path, args, lock
        self.failures = 0
        self.moved = 0  # bytes of the file's current attempt, for progress
        self.mutex = threading.Lock()

    def check_lock(self):
        if self.lock.lost.is_set():
            raise FetchError(EXIT_FAILED, "lost the cache lock (another host broke it); "
                             "re-run to finish")

    def fail(self, exc: BaseException):
        with self.mutex:
            self.failures += 1
            n = self.failures
        why = f"{type(exc).__name__}: {_first_line(exc)}"
        if n >= self.args.retries:
            if isinstance(exc, FetchError):
                raise exc
            raise FetchError(EXIT_FAILED, f"{self.path}: failed {self.args.retries} times "
                             f"(last: {why}); re-run to continue, verified files are kept")
        delay = min(60.0, self.args.backoff * 2 ** (n - 1))
        log(f"{self.path}: attempt {n}/{self.args.retries} failed ({why}); retrying in "
            f"{delay:.1f} s")
        time.sleep(delay)
        self.check_lock()


class Fetch:
    def __init__(self, args, token: str | None):
        self.args = args
        self.token = token
        self.hub = Path(args.cache_dir) / "hub"
        self.repo_dir = self.hub / ("models--" + args.repo.replace("/", "--"))
        self.mlock = threading.Lock()
        self.bytes_downloaded = 0
        self.bytes_hashed_in_flight = 0  # verified by StreamHash, no second read
        self.replaced: list[str] = []
        self.downloaded: list[str] = []
        self.done = 0
        self.total = 0
        self.moved = 0  # bytes received so far, for progress
        self.need = 0  # bytes this fetch downloads, once known
        self.t0 = time.monotonic()
        self.part = args.part_mib * MIB
        # --share I/K: this fetcher's own lock, staging and manifest next to the others'
        self.share_name = f"share-{args.share[0]}-of-{args.share[1]}" if args.share else ""
        self.staging_root = self.repo_dir / ".gpufleet-staging"
        self.opener = opener(args.source_address)
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # parts ahead
        self.connection = threading.BoundedSemaphore(args.workers)  # requests at once
        self.active = 0  # files their own thread is moving now
        self.ahead = 0  # parts fetched ahead now

    # ---- hub
    def resolve(self):
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.args.endpoint, token=self.token or False)
        try:
            info = api.model_info(self.args.repo, revision=self.args.revision,
                                  files_metadata=True, timeout=self.args.timeout)
        except Exception as exc:  # noqa: BLE001 - every failure gets an exit code and a fix
            raise classify(exc, self.args, self.token) from None
        files = []
        for s in info.siblings or []:
            lfs = s.lfs.sha256 if s.lfs else None
            files.append({"path": s.rfilename, "size": s.size, "lfs": lfs, "blob_id": s.blob_id})
        return info.sha, files

    def probe_access(self, sha: str, path: str):
        """One HEAD before any byte moves: a gated repo or a bad token fails here."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.args.repo, path, revision=sha, endpoint=self.args.endpoint)
        try:
            get_hf_file_metadata(url, token=self.token or False, timeout=self.args.timeout)
        except Exception as exc:  # noqa: BLE001
            raise classify(exc, self.args, self.token) from None

    # ---- paths
    def etag(self, f: dict) -> str:
        return f["lfs"] or f["blob_id"]

    def blob(self, f: dict) -> Path:
        return self.repo_dir / "blobs" / self.etag(f)

    def snap(self, sha: str, f: dict) -> Path:
        return self.repo_dir / "snapshots" / sha / f["path"]

    def manifest_path(self, sha: str) -> Path:
        """The manifest; a share's own while it fetches its part (--share)."""
        return self.repo_dir / f".gpufleet-manifest-{sha}{suffix(self.share_name)}.json"

    # ---- manifest
    def load_manifest(self, sha: str) -> dict:
        """Verified entries: this manifest's and every share's (a share's entry is trusted
        like our own: a blob only lands in blobs/ after its hash matched)."""
        entries: dict = {}
        own = self.manifest_path(sha)
        for path in sorted(self.repo_dir.glob(f".gpufleet-manifest-{sha}.share-*.json")) + [own]:
            try:
                entries.update({e["file"]: e for e in read_manifest(path).get("files", [])})
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return entries

    def forget_shares(self, sha: str):
        """The complete manifest holds the shares' entries now."""
        for path in self.repo_dir.glob(f".gpufleet-manifest-{sha}.share-*.json"):
            with contextlib.suppress(OSError):
                path.unlink()

    def save_manifest(self, sha: str, entries: dict, complete: bool):
        data = {"repo": self.args.repo, "revision": self.args.revision, "commit": sha,
                "endpoint": self.args.endpoint, "complete": complete,
                "files": [entries[k] for k in sorted(entries)]}
        try:  # unchanged: leave the file as it is (a re-run touches nothing)
            old = read_manifest(self.manifest_path(sha))
            if {k: v for k, v in old.items() if k != "written_at"} == data:
                return
        except (OSError, ValueError):
            pass
        data["written_at"] = now_iso()
        self.repo_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.manifest_path(sha), (json.dumps(data, indent=1) + "\n").encode())

    def record(self, entries: dict, f: dict, blob: Path, digest: str):
        st = blob.stat()
        entries[f["path"]] = {"file": f["path"], "size": st.st_size, "sha256": digest,
                              "etag": self.etag(f), "mtime": st.st_mtime_ns,
                              "verified_at": now_iso()}

    # ---- what a serving host sees (--check-files)
    def local_commit(self) -> str:
        """--revision as a commit: a branch or tag through the ref a complete fetch wrote."""
        rev = self.args.revision
        ref = self.repo_dir / "refs" / rev
        if re.fullmatch(r"[0-9a-f]{40}", rev) or not ref.is_file():
            return rev
        return ref.read_text().strip()

    def check_files(self) -> dict:
        """The manifest is complete and every file it lists is in the snapshot with the
        manifest's size, readable by other users. Reads 4 KiB of each file; hashes nothing."""
        sha = self.local_commit()
        manifest, snapshot = self.manifest_path(sha), self.repo_dir / "snapshots" / sha
        try:
            data = read_manifest(manifest)
        except (OSError, ValueError) as exc:
            return {"files": 0, "problems": [f"manifest {manifest}: {exc}"]}
        problems = []
        if not data.get("complete"):
            problems.append(f"manifest {manifest} is not complete")
        files = data.get("files", [])
        for entry in files:
            path = snapshot / entry["file"]
            try:
                st = path.stat()
                with open(path, "rb") as fh:
                    fh.read(4096)
            except OSError as exc:
                problems.append(f"{path}: {exc.strerror}")
                continue
            if st.st_size != entry["size"]:
                problems.append(f"{path}: {st.st_size} bytes, manifest says {entry['size']}")
            elif not st.st_mode & 0o004:
                problems.append(f"{path}: not readable by other users "
                                f"(mode {st.st_mode & 0o777:o})")
        return {"files": len(files), "problems": problems}

    # ---- verification of what is on disk
    def check(self, sha: str, f: dict, entries: dict, full: bool) -> bool:
        """True when the file is in place and verified; else removes what is wrong."""
        blob, snap = self.blob(f), self.snap(sha, f)
        if not blob.is_file():
            if (snap.is_symlink() or snap.exists()) and not self.args.dry_run:
                snap.unlink()
            entries.pop(f["path"], None)
            return False
        st = blob.stat()
        entry = entries.get(f["path"])
        trusted = (not full and entry is not None and entry.get("size") == f["size"]
                   and entry.get("mtime") == st.st_mtime_ns and entry.get("etag") == self.etag(f)
                   and st.st_size == f["size"])
        if not trusted:
            ok = st.st_size == f["size"] and hash_file(blob, bool(f["lfs"]), f["size"]) == (
                f["lfs"] or f["blob_id"])
            if not ok and self.args.dry_run:
                log(f"{f['path']}: on-disk copy does not match the Hub's hash; would replace it")
                self.replaced.append(f["path"])
                return False
            if not ok:
                log(f"{f['path']}: on-disk copy does not match the Hub's hash; removing it")
                if snap.is_symlink() or snap.exists():
                    snap.unlink()
                blob.unlink()
                entries.pop(f["path"], None)
                with self.mlock:
                    self.replaced.append(f["path"])
                return False
            digest = f["lfs"] or sha256_file(blob)
            self.record(entries, f, blob, digest)
        if not self.args.dry_run:
            if st.st_mode & 0o444 != 0o444:  # serving units may run as another user
                os.chmod(blob, 0o644)
            self.link(sha, f)
        return True

    def link(self, sha: str, f: dict):
        blob, snap = self.blob(f), self.snap(sha, f)
        target = os.path.relpath(blob, snap.parent)
        if snap.is_symlink() and os.readlink(snap) == target:
            return
        snap.parent.mkdir(parents=True, exist_ok=True)
        atomic_symlink(target, snap)

    # ---- download
    def download(self, sha: str, f: dict, staging: Path, entries: dict, lock: SharedLock):
        budget = Budget(f["path"], self.args, lock)
        while True:
            budget.check_lock()
            start = time.monotonic()
            try:
                staged, digest = self.transfer(sha, f, staging, budget)
                if staged.stat().st_size != f["size"] or digest != self.etag(f):
                    staged.unlink()
                    raise FetchError(EXIT_FAILED, f"{f['path']}: downloaded bytes do not match "
                                     "the Hub's hash")
            except Exception as exc:  # noqa: BLE001 - retried or classified below
                if not isinstance(exc, FetchError) and not retryable(exc):
                    raise classify(exc, self.args, self.token) from None
                if isinstance(exc, FetchError) and exc.code != EXIT_FAILED:
                    raise
                self.count(-budget.moved, budget)  # progress counts the next attempt afresh
                budget.fail(exc)  # raises when the file has no attempt left
                continue
            blob = self.blob(f)
            blob.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(staged, 0o644)  # serving units may run as another user
            os.replace(staged, blob)  # same filesystem: atomic, verified bytes only
            self.adopt(sha, f, entries, f["lfs"] or sha256_file(blob))
            with self.mlock:
                self.bytes_downloaded += f["size"]
                self.downloaded.append(f["path"])
                self.done += 1
                self.save_manifest(sha, entries, complete=False)
                secs = max(time.monotonic() - start, 1e-6)
                log(f"fetched {f['path']} {human(f['size'])} in {secs:.1f} s "
                    f"({human(f['size'] / secs)}/s) [{self.done}/{self.total} files]")
            return

    def adopt(self, sha: str, f: dict, entries: dict, digest: str):
        """A verified blob in place: the file's manifest entry and snapshot link."""
        with self.mlock:
            self.record(entries, f, self.blob(f), digest)
            self.link(sha, f)

    def transfer(self, sha: str, f: dict, staging: Path, budget: Budget) -> tuple[Path, str]:
        """One attempt at a file: (the staged file, its hash as the Hub names files)."""
        with self.mlock:
            self.active += 1
        try:
            return self._transfer(sha, f, staging, budget)
        finally:
            with self.mlock:
                self.active -= 1

    def _transfer(self, sha: str, f: dict, staging: Path, budget: Budget) -> tuple[Path, str]:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.args.repo, f["path"], revision=sha, endpoint=self.args.endpoint)
        meta = get_hf_file_metadata(url, token=self.token or False, timeout=self.args.timeout)
        if getattr(meta, "xet_file_data", None) is not None:
            return self.transfer_xet(sha, f, staging, budget)
        location = meta.location or url
        # the Hub client's rule: the token goes only to the host that issued it
        same_host = urlsplit(location).netloc == urlsplit(self.args.endpoint).netloc
        auth = f"Bearer {self.token}" if self.token and same_host else None
        staged = staging / "blobs" / self.etag(f)
        staged.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, f["size"])  # the file's final size; parts fill it in any order
            if f["size"] > self.part:
                try:
                    return staged, self.parts(location, auth, fd, f, budget)
                except RangesIgnored:
                    log(f"{f['path']}: {urlsplit(location).netloc} ignores byte ranges; "
                        "taking the file in one stream")
            return staged, self.stream(location, auth, fd, f, budget)
        finally:
            os.close(fd)

    def transfer_xet(self, sha: str, f: dict, staging: Path, budget: Budget) -> tuple[Path, str]:
        """A file stored in Xet: huggingface_hub's Xet client moves it (chunk dedup,
        parallel ranges in Rust), hashed as it is written (StreamHash)."""
        from huggingface_hub import hf_hub_download

        # progress as the follower hashes what the Xet client has written
        follower = StreamHash(staging / self.repo_dir.name / "blobs", self.etag(f),
                              bool(f["lfs"]), f["size"], lambda n: self.count(n, budget))
        follower.start()
        try:
            staged = hf_hub_download(self.args.repo, f["path"], revision=sha,
                                     cache_dir=staging, endpoint=self.args.endpoint,
                                     token=self.token or False)
        finally:
            follower.stop()
        staged = Path(os.path.realpath(staged))
        self.count(max(0, f["size"] - follower.read), budget)  # what it did not follow
        digest = follower.digest(staged)
        if digest != self.etag(f):  # not followed to the end, or wrong: from disk
            return staged, hash_file(staged, bool(f["lfs"]), f["size"])
        with self.mlock:
            self.bytes_hashed_in_flight += f["size"]
        return staged, digest

    def count(self, n: int, budget: Budget):
        with self.mlock:
            self.moved += n
            budget.moved += n

    def request(self, url: str, auth: str | None, first: int | None, last: int):
        req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
        if auth:  # not carried over a redirect: urllib drops unredirected headers
            req.add_unredirected_header("Authorization", auth)
        if first is not None:
            req.add_header("Range", f"bytes={first}-{last}")
        try:
            return self.opener.open(req, timeout=self.args.timeout)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403, 404, 410) and not auth:
                exc.close()  # a signed CDN link that expired: the next attempt resolves again
                raise LinkRefused(f"{urlsplit(url).netloc} answered HTTP {exc.code}") from None
            raise

    def retry(self, exc: BaseException, budget: Budget):
        """A request failed: take an attempt and go on, unless asking again cannot help."""
        if isinstance(exc, urllib.error.HTTPError) and not retryable(exc):
            raise exc
        budget.fail(exc)

    def stream(self, url: str, auth: str | None, fd: int, f: dict, budget: Budget) -> str:
        """The whole file in one GET, written and hashed as it arrives; a failure starts
        the file again (a server that ignores ranges cannot resume)."""
        buf = memoryview(bytearray(MIB))
        while True:
            h, got = new_hash(bool(f["lfs"]), f["size"]), 0
            try:
                with self.connection, self.request(url, auth, None, 0) as resp:
                    while got < f["size"]:
                        n = resp.readinto(buf)
                        if not n:
                            break
                        pwrite_all(fd, buf[:n], got)
                        h.update(buf[:n])
                        got += n
                        self.count(n, budget)
                if got != f["size"]:
                    raise ShortBody(f"{got} of {f['size']} bytes")
                with self.mlock:
                    self.bytes_hashed_in_flight += got
                return h.hexdigest()
            except (OSError, http.client.HTTPException) as exc:
                self.count(-got, budget)
                self.retry(exc, budget)

    def parts(self, url: str, auth: str | None, fd: int, f: dict, budget: Budget) -> str:
        """--part-mib ranges, hashed in file order. The file's own thread reads its next
        part itself and hashes each read as it lands, while the bytes are still in the CPU's
        cache; a connection with nothing else to do fetches one of the following parts into
        memory, hashed from there when the thread reaches it (at most PART_WINDOW parts of
        the file in flight or waiting). With as many files in flight as connections every
        byte is hashed as it lands; ranges ahead fill the connections a file's tail leaves
        idle. Measured: hashing 16 MiB parts from memory after they landed moved half the
        bytes per second at twice the CPU (docs/performance.md)."""
        size, h = f["size"], new_hash(bool(f["lfs"]), f["size"])
        count = -(-size // self.part)
        ahead: dict[int, concurrent.futures.Future] = {}
        buf = memoryview(bytearray(MIB))

        def span(i: int) -> tuple[int, int]:
            return i * self.part, min((i + 1) * self.part, size) - 1

        try:
            for i in range(count):
                for j in range(i + 1, min(count, i + PART_WINDOW)):
                    if j not in ahead and self.idle_connection():
                        ahead[j] = self.pool.submit(self.part_ahead, url, auth, fd, *span(j),
                                                    budget)
                if i in ahead:
                    h.update(ahead.pop(i).result())
                else:
                    with self.connection:
                        self.part_inline(url, auth, fd, *span(i), h, buf, budget)
        finally:
            for fut in ahead.values():
                if fut.cancel():
                    self.give_back()  # never ran, so never gave it back
            concurrent.futures.wait(ahead.values())  # none writes into fd once it is closed
        with self.mlock:
            self.bytes_hashed_in_flight += size
        return h.hexdigest()

    def ranged(self, url: str, auth: str | None, first: int, last: int, budget: Budget,
               take) -> None:
        """Bytes first..last: ``take(resp, offset)`` reads from the response the bytes at
        ``offset`` on and returns how many; a failed request resumes from the byte it
        reached."""
        got = first
        while got <= last:
            budget.check_lock()
            try:
                with self.request(url, auth, got, last) as resp:
                    if resp.status != 206:
                        raise RangesIgnored
                    while got <= last:
                        n = take(resp, got)
                        if not n:
                            break
                        got += n
                        self.count(n, budget)
                if got <= last:
                    raise ShortBody(f"bytes {got}-{last} missing")
            except (OSError, http.client.HTTPException) as exc:
                self.retry(exc, budget)

    def part_inline(self, url: str, auth: str | None, fd: int, first: int, last: int, h,
                    buf: memoryview, budget: Budget) -> None:
        """Bytes first..last through ``buf``: each read written and hashed at once."""
        def take(resp, at: int) -> int:
            n = resp.readinto(buf[:min(len(buf), last + 1 - at)])
            pwrite_all(fd, buf[:n], at)
            h.update(buf[:n])
            return n

        self.ranged(url, auth, first, last, budget, take)

    def part_ahead(self, url: str, auth: str | None, fd: int, first: int, last: int,
                   budget: Budget) -> memoryview:
        """Bytes first..last into memory (for the hash) and into the staging file, on a
        connection taken for it by parts()."""
        try:
            view = memoryview(bytearray(last - first + 1))
            self.ranged(url, auth, first, last, budget,
                        lambda resp, at: resp.readinto(view[at - first:]))
            pwrite_all(fd, view, first)
            return view
        finally:
            self.give_back()

    def idle_connection(self) -> bool:
        """A connection for a part ahead: one that no file's own thread will want (fewer
        files in flight than --workers: a checkpoint's last files, or one large file)."""
        with self.mlock:
            if self.ahead >= self.args.workers - self.active:
                return False
            if not self.connection.acquire(blocking=False):
                return False
            self.ahead += 1
            return True

    def give_back(self):
        with self.mlock:
            self.ahead -= 1
        self.connection.release()

    def progress(self, stop: threading.Event):
        while not stop.wait(self.args.progress_interval):
            line = self.status("running")
            log(f"progress: {line['files_done']}/{line['files']} files, "
                f"{human(line['bytes_done'])} of {human(self.need)}, "
                f"{human(line['rate_bytes_s'])}/s"
                + (f", {line['eta_s']:.0f} s left" if line["eta_s"] is not None else ""))

    def status(self, state: str, error: str | None = None) -> dict:
        """What --status-file holds: where the fetch is, written atomically."""
        need = self.need
        with self.mlock:
            got, done = self.moved, self.done
        secs = max(time.monotonic() - self.t0, 1e-6)
        rate = got / secs
        line = {"pid": os.getpid(), "host": socket.gethostname(), "repo": self.args.repo,
                "state": state, "files_done": done, "files": self.total, "bytes_done": got,
                "bytes_total": need, "rate_bytes_s": round(rate),
                "eta_s": round((need - got) / rate) if rate > 0 and state == "running" else None,
                "seconds": round(secs, 1), "updated": now_iso()}
        if error:
            line["error"] = error
        if self.args.status_file:
            with contextlib.suppress(OSError):
                path = Path(self.args.status_file)
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, (json.dumps(line) + "\n").encode())
        return line

    # ---- main
    def run(self) -> dict:
        args = self.args
        full = args.verify == "full"
        sha, listing = self.resolve()
        files = select(listing, args.allow)
        if not files:
            raise FetchError(EXIT_NOT_FOUND, f"no file of {args.repo}@{sha} matches "
                             f"{args.allow or 'the default engine file set'}")
        log(f"{args.repo}@{args.revision} is commit {sha}: {len(files)} files, "
            f"{human(sum(f['size'] for f in files))}")
        if args.share:
            files = share_of(files, *args.share)
            log(f"share {args.share[0]} of {args.share[1]}: {len(files)} files, "
                f"{human(sum(f['size'] for f in files))}")
        if args.access_only:  # preflight: the revision exists and the token may read it
            self.probe_access(sha, files[0]["path"])
            return {"repo": args.repo, "revision": args.revision, "commit": sha,
                    "files": len(files), "changed": False, "access": "ok"}
        if args.dry_run:  # read-only: no lock, no manifest, nothing removed
            return self._locked(sha, files, full, None)
        self.hub.mkdir(parents=True, exist_ok=True)
        lock = SharedLock(self.lock_path(), stale=args.lock_stale, timeout=args.lock_timeout)
        waited = lock.acquire()
        try:
            result = self._locked(sha, files, full, lock)
        finally:
            lock.release()
        result.update(waited_for_lock_s=round(lock.waited, 1), lock_was_held=waited)
        return result

    def lock_path(self, share_name: str | None = None) -> Path:
        name = self.share_name if share_name is None else share_name
        return self.hub / ".gpufleet-locks" / f"{self.repo_dir.name}{suffix(name)}.lock"

    def clean_staging(self):
        """We hold our lock: staging left in our place was a killed run's partial files. The
        whole fetch also takes what shares left whose fetcher holds no lock any more."""
        if self.args.share:
            shutil.rmtree(self.staging_root / self.share_name, ignore_errors=True)
            return
        for path in self.staging_root.glob("*"):
            held = path.name.startswith("share-") and self.lock_path(path.name).exists()
            if not held:
                shutil.rmtree(path, ignore_errors=True)

    def _locked(self, sha: str, files: list[dict], full: bool, lock: SharedLock | None) -> dict:
        args = self.args
        entries = self.load_manifest(sha)
        entries = {k: v for k, v in entries.items() if k in {f["path"] for f in files}}
        missing = [f for f in files if not self.check(sha, f, entries, full)]
        if not args.dry_run:
            self.save_manifest(sha, entries, complete=not missing)
            self.clean_staging()
        # files with the same content share one blob: fetched once, the others linked to it
        first: dict = {}
        for f in missing:
            first.setdefault(self.etag(f), f)
        twins = [f for f in missing if first[self.etag(f)] is not f]
        need = sum(f["size"] for f in first.values())
        existing = self.hub
        while not existing.exists():  # a dry run before the cache dir exists
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        if os.environ.get(FAKE_FREE_ENV):
            free = int(os.environ[FAKE_FREE_ENV])
        reserve = int(args.min_free_gib * GIB)
        summary = {"repo": args.repo, "revision": args.revision, "commit": sha,
                   "cache_dir": args.cache_dir, "hub": str(self.hub),
                   "snapshot": str(self.repo_dir / "snapshots" / sha),
                   "manifest": str(self.manifest_path(sha)), "files": len(files),
                   "total_bytes": sum(f["size"] for f in files), "to_download": len(missing),
                   "need_bytes": need, "free_bytes": free}
        if need and free - need < reserve:
            raise FetchError(EXIT_DISK, f"needs {need / GIB:.2f} GiB (+{args.min_free_gib:g} GiB "
                             f"reserve), {free / GIB:.2f} GiB free on {args.cache_dir}: free "
                             "space or point gpufleet_cache_dir at a bigger filesystem")
        if args.dry_run or not missing:
            if missing:
                log(f"would download {len(missing)} files, {human(need)}: "
                    + ", ".join(f["path"] for f in missing))
            return self._summary(summary, complete=not missing)
        self.probe_access(sha, missing[0]["path"])
        log(f"downloading {len(missing)} files, {human(need)} ({human(free)} free) "
            f"over {args.workers} connections")
        self.total, self.need = len(first), need
        staging = self.staging_root / self.share_name / uuid.uuid4().hex[:12]
        staging.mkdir(parents=True)
        stop = threading.Event()
        self.status("running")
        ticker = threading.Thread(target=self.progress, args=(stop,), daemon=True)
        ticker.start()
        try:
            # files in parallel, --workers requests at once (self.connection) in all
            with concurrent.futures.ThreadPoolExecutor(args.workers) as self.pool, \
                    concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
                futures = [pool.submit(self.download, sha, f, staging, entries, lock)
                           for f in sorted(first.values(), key=lambda f: -f["size"])]
                errors = []
                for fut in concurrent.futures.as_completed(futures):
                    if not fut.cancelled() and fut.exception() is not None:
                        errors.append(fut.exception())
                        for other in futures:  # stop queued files; running ones finish
                            other.cancel()
            if errors:
                raise errors[0]
        finally:
            stop.set()
            shutil.rmtree(staging, ignore_errors=True)
            for empty in (staging.parent, self.staging_root):
                with contextlib.suppress(OSError):
                    empty.rmdir()
        for f in twins:
            self.adopt(sha, f, entries, entries[first[self.etag(f)]["path"]]["sha256"])
        self.save_manifest(sha, entries, complete=True)
        return self._summary(summary, complete=True)

    def write_ref(self, sha: str):
        if self.args.revision != sha:
            ref = self.repo_dir / "refs" / self.args.revision
            if ref.is_file() and ref.read_text() == sha:
                return
            ref.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(ref, sha.encode())

    def _summary(self, summary: dict, complete: bool) -> dict:
        if complete and not self.args.dry_run and not self.args.share:
            self.write_ref(summary["commit"])
            self.forget_shares(summary["commit"])
        secs = max(time.monotonic() - self.t0, 1e-6)
        summary.update(complete=complete, dry_run=self.args.dry_run,
                       downloaded=sorted(self.downloaded), replaced=sorted(self.replaced),
                       bytes_downloaded=self.bytes_downloaded,
                       bytes_hashed_in_flight=self.bytes_hashed_in_flight,
                       changed=bool(self.downloaded or self.replaced), seconds=round(secs, 2),
                       rate_mib_s=round(self.bytes_downloaded / secs / 2**20, 1))
        return summary


# --------------------------------------------------------------------------- CLI


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", help="model repo id, e.g. zai-org/GLM-5.3-Flash")
    p.add_argument("--revision", default="main", help="branch, tag or commit id")
    p.add_argument("--cache-dir", help="shared cache root (files go to DIR/hub)")
    p.add_argument("--endpoint", default=None,
                   help=f"Hub or mirror URL (default: $HF_ENDPOINT or {DEFAULT_ENDPOINT})")
    p.add_argument("--allow", action="append", default=None, metavar="PATTERN",
                   help="download files matching PATTERN (repeatable; replaces the default set)")
    p.add_argument("--workers", type=int, default=8,
                   help="connections (and files) in parallel")
    p.add_argument("--part-mib", type=int, default=16,
                   help="a file larger than this moves in range requests of this size")
    p.add_argument("--share", default=None, metavar="I/K",
                   help="fetch only share I of K (several hosts, one share each, fill one "
                   "shared cache; a run without --share then completes the manifest)")
    p.add_argument("--source-address", default=None, metavar="ADDR",
                   help="local address of the download connections (a host on several "
                   "networks: the address facing the mirror)")
    p.add_argument("--xet-concurrency", type=int, default=None,
                   help="fixed download concurrency for files stored in Xet "
                   "(HF_XET_FIXED_DOWNLOAD_CONCURRENCY; for throttled links)")
    p.add_argument("--verify", choices=("fast", "full"), default="fast",
                   help="fast trusts manifest entries whose size and mtime match; full rehashes")
    p.add_argument("--min-free-gib", type=float, default=0.0,
                   help="GiB that must stay free on the cache filesystem after the download")
    p.add_argument("--lock-timeout", type=float, default=6 * 3600,
                   help="seconds to wait for another fetch's lock")
    p.add_argument("--lock-stale", type=float, default=120.0,
                   help="a lock whose heartbeat has not changed for this long is broken")
    p.add_argument("--retries", type=int, default=5, help="attempts per file")
    p.add_argument("--backoff", type=float, default=2.0,
                   help="first retry delay in seconds (doubles, capped at 60)")
    p.add_argument("--timeout", type=float, default=30.0, help="metadata request timeout")
    p.add_argument("--progress-interval", type=float, default=10.0)
    p.add_argument("--token-file", default=None,
                   help="file holding the token (else $HF_TOKEN); never pass a token in argv")
    p.add_argument("--log-file", default=None, help="also append progress lines here")
    p.add_argument("--status-file", default=None,
                   help="keep the fetch's progress (JSON) in this file")
    p.add_argument("--status", default=None, metavar="STATUS_FILE",
                   help="print the progress a fetch keeps in STATUS_FILE and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="report what would be downloaded; download nothing")
    p.add_argument("--access-only", action="store_true",
                   help="only check that the revision exists and is readable with the token "
                   "(reads metadata and one file header; writes nothing)")
    p.add_argument("--check-files", action="store_true",
                   help="read-only, offline: check that this host sees the fetched revision "
                   "(complete manifest; every file there, of its size, readable by all)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = p.parse_args(argv)
    args.endpoint = (args.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)
    args.endpoint = args.endpoint.rstrip("/")
    if args.workers < 1 or args.retries < 1 or args.part_mib < 1:
        p.error("--workers, --retries and --part-mib must be at least 1")
    if args.status:
        return args
    if not args.repo or not args.cache_dir:
        p.error("--repo and --cache-dir are required")
    if args.share is not None:
        match = re.fullmatch(r"(\d+)/(\d+)", args.share)
        if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
            p.error(f"--share {args.share!r}: I/K with 1 <= I <= K, e.g. 2/4")
        args.share = (int(match.group(1)), int(match.group(2)))
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo):
        p.error(f"--repo {args.repo!r} is not an org/name repo id")
    return args


def read_token(args) -> str | None:
    if args.token_file:
        try:
            return Path(args.token_file).read_text().strip() or None
        except OSError as exc:
            raise FetchError(EXIT_AUTH, f"cannot read --token-file {args.token_file}: "
                             f"{exc.strerror}: {TOKEN_FIX}") from None
    return os.environ.get("HF_TOKEN", "").strip() or None


def check_files(args) -> int:
    """--check-files; with --json the result is all it prints (Ansible's script module
    runs it on a terminal, where stderr lands in stdout)."""
    result = Fetch(args, None).check_files()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for problem in result["problems"]:
            log(f"problem: {problem}")
        if not result["problems"]:
            log(f"{args.repo}@{args.revision}: all {result['files']} files of the manifest seen")
    return EXIT_FAILED if result["problems"] else EXIT_OK


def show_status(path: str) -> int:
    """--status: the progress a fetch keeps in its --status-file, as JSON on one line;
    a "running" fetch whose process is gone is "gone" (killed, or its host rebooted)."""
    try:
        line = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        line = {"state": "starting"}  # not written yet
    if line.get("state") == "running" and line.get("host") == socket.gethostname():
        try:
            os.kill(int(line["pid"]), 0)
        except ProcessLookupError:
            line["state"] = "gone"
        except (OSError, KeyError, ValueError):
            pass
    print(json.dumps(line))
    return EXIT_OK


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.status:
        return show_status(args.status)
    if args.check_files:  # no token, no lock, no Hub
        return check_files(args)
    try:
        token = read_token(args)
    except FetchError as err:
        log(f"error: {err}")
        return err.code
    sys.stdout = Redactor(sys.stdout, [token or ""])
    sys.stderr = Redactor(sys.stderr, [token or ""])
    os.umask(0o022)  # the cache is read by every serving host and unit user
    if args.log_file:
        Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
        LOG_FILE.append(Redactor(open(args.log_file, "a"), [token or ""]))  # noqa: SIM115
    # the fetch talks to the endpoint whatever the serving environment says
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        os.environ.pop(name, None)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"
    os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")  # files in Xet: every core
    if args.xet_concurrency:
        os.environ["HF_XET_FIXED_DOWNLOAD_CONCURRENCY"] = str(args.xet_concurrency)
    fetch = Fetch(args, token)
    if args.status_file and not args.access_only:
        fetch.status("running")  # resolving: no total yet
    try:
        summary = fetch.run()
        code = EXIT_OK
    except FetchError as err:
        log(f"error: {err}")
        summary = {"repo": args.repo, "revision": args.revision, "error": str(err),
                   "exit_code": err.code, "bytes_downloaded": fetch.bytes_downloaded,
                   "changed": bool(fetch.downloaded or fetch.replaced)}
        code = err.code
    except KeyboardInterrupt:
        log("interrupted; verified files are kept, re-run to continue")
        return 130
    except Exception as exc:  # noqa: BLE001 - never a traceback that could carry headers
        err = classify(exc, args, token)
        log(f"error: {err}")
        summary = {"repo": args.repo, "error": str(err), "exit_code": err.code}
        code = err.code
    if args.status_file and not args.access_only:
        fetch.status("done" if code == EXIT_OK else "failed", summary.get("error"))
    if code == EXIT_OK and args.access_only:
        log(f"{args.repo}@{args.revision}: readable ({summary['files']} files)")
    elif code == EXIT_OK and not summary["complete"]:
        log(f"dry run: {summary['to_download']} files to download, nothing changed")
    elif code == EXIT_OK:
        log(f"done: {summary['files']} files verified in {summary['snapshot']}, "
            f"{human(summary['bytes_downloaded'])} downloaded")
    if args.json:
        print(json.dumps(summary, indent=1))
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())

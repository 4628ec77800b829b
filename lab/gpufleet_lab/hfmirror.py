"""A Hugging Face Hub-compatible checkpoint mirror for the lab.

The real ``huggingface_hub`` client downloads from it through ``HF_ENDPOINT``, exactly as
it would from the Hub or from a corporate mirror. It serves small placeholder checkpoints
under the real repo ids (real-looking config, tokenizer, valid safetensors shards and
their index) with deterministic content, so SHA-256s, git blob ids and commit ids are
stable, and one real model under its own id, ``gpufleet-lab/GLM-5.3-Tiny``: a small Llama
decoder of random weights a real engine loads and runs. It can gate a repo behind a token
and cut transfers mid-file on request.

Why not an existing mirror: ``olah`` (PyPI, 0.5.4) was evaluated. It is a proxy/cache
for the Hub; its offline "mirrors-path" mode serves local *git* repositories whose LFS
objects must sit in ``.git/lfs/objects``, so every placeholder checkpoint would have to
be built as a git+LFS repository first. It needs about twenty third-party packages
(FastAPI, uvicorn, pydantic-settings, GitPython, peewee, brotli, ...) on the controller,
reads whole LFS files into memory, and has nothing for what the lab tests need: cutting
a transfer at a byte offset, counting bytes served per file, or simulating gated repos
and invalid tokens with the Hub's error headers. A stdlib server is smaller than the
glue olah would need, so this is one.

What the client (huggingface_hub 2.4.0) relies on, and this server provides:
- ``GET /api/models/{repo}[/revision/{rev}]`` with ``sha`` and ``siblings``; with
  ``?blobs=true`` each sibling has ``size``, ``blobId`` and ``lfs`` {sha256,size,pointerSize}.
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``snapshot_download`` lists files there).
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (SHA-256 for
  LFS files, git blob sha1 otherwise), ``X-Linked-Etag``/``X-Linked-Size`` for LFS files,
  ``Content-Length``, ``Accept-Ranges`` and single ``Range`` requests (206). No Xet
  headers, so the client uses plain HTTP even with ``hf_xet`` installed.
- Errors as the Hub sends them: ``X-Error-Code`` (GatedRepo, RepoNotFound,
  RevisionNotFound, EntryNotFound) and ``X-Error-Message``; an unknown token gets 401
  "Invalid credentials in Authorization header".

Options for measuring clients (all off by default; the admin endpoints change them while
the server runs):
- A rate limit on file bodies (``--rate-limit-mib R``; ``POST /_admin/rate?mib=R&per=P``,
  ``mib=0`` is none): a token bucket of R MiB/s shared by all connections from one client
  address (``--rate-limit-per client``, the default: a host's link) or one for each TCP
  connection (``connection``). Bodies go out in pieces of about R/20, so the rate is
  smooth, and no idle time is banked, so a short transfer is not faster; cuts still apply.
- A CDN redirect like the Hub's (``--lfs-redirect``; ``POST /_admin/lfs-redirect?on=1``):
  resolving an LFS file answers 302 with ``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``,
  ``X-Linked-Size`` and an absolute ``Location`` to ``/_cdn/{sha256}?...`` on another host
  name for this same server (127.0.0.1 and localhost swap; ``--cdn-host`` for others). The
  ``/_cdn/`` path serves the blob with ranges and never checks a token; each request there
  that carries an ``Authorization`` header is counted in the stats
  (``cdn_requests_with_authorization``), so a test can show a client kept its token on the
  host that issued it. Gated repos check the token on the resolve, before the redirect.

The access log prints method, path (without query) and status only; never headers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import hashlib
import json
import math
import random
import socket
import struct
import sys
import threading
import time
import uuid
from array import array
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO
from urllib.parse import parse_qs, quote, unquote, urlsplit

DATA_DIR = Path(__file__).with_name("hfmirror_data")
LAST_MODIFIED = "2026-05-01T00:00:00.000Z"
BLOCK = 1 << 16  # synthetic data is built from 64 KiB blocks
SEND_CHUNK = 1 << 20
MIB = 1 << 20
DTYPE_SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --------------------------------------------------------------------------- content


class Blob:
    """File content: a size, hashes, and chunks of any byte range."""

    size: int

    def chunks(self, start: int, end: int):
        raise NotImplementedError

    def read(self) -> bytes:
        return b"".join(self.chunks(0, self.size))

    def _hash(self) -> str:
        h = hashlib.sha256()
        for chunk in self.chunks(0, self.size):
            h.update(chunk)
        return h.hexdigest()


class BytesBlob(Blob):
    def __init__(self, data: bytes):
        self.data = data
        self.size = len(data)
        self.sha256 = hashlib.sha256(data).hexdigest()

    def chunks(self, start: int, end: int):
        for pos in range(start, end, SEND_CHUNK):
            yield self.data[pos : min(end, pos + SEND_CHUNK)]


class SyntheticBlob(Blob):
    """``prefix`` followed by ``data_size`` deterministic pseudo-random bytes from ``seed``.

    The data is a 64 KiB SHAKE-256 block, rotated differently for each block, so big files
    cost no memory and hash at hashlib speed.
    """

    def __init__(self, seed: str, data_size: int, prefix: bytes = b""):
        self.prefix = prefix
        self.base = hashlib.shake_256(seed.encode()).digest(BLOCK)
        self.size = len(prefix) + data_size
        self.sha256 = self._hash()

    def _block(self, index: int) -> bytes:
        r = (index * 4099) % BLOCK
        return self.base[r:] + self.base[:r]

    def chunks(self, start: int, end: int):
        if start < len(self.prefix):
            yield self.prefix[start : min(end, len(self.prefix))]
            start = len(self.prefix)
        pos = start - len(self.prefix)
        stop = end - len(self.prefix)
        while pos < stop:
            index, offset = divmod(pos, BLOCK)
            piece = self._block(index)[offset : offset + stop - pos]
            yield piece
            pos += len(piece)


@dataclass
class RepoFile:
    path: str
    blob: Blob
    lfs: bool

    @property
    def size(self) -> int:
        return self.blob.size

    @property
    def sha256(self) -> str:
        return self.blob.sha256

    @property
    def pointer(self) -> bytes:
        return (
            "version https://git-lfs.github.com/spec/v1\n"
            f"oid sha256:{self.sha256}\nsize {self.size}\n"
        ).encode()

    @property
    def oid(self) -> str:
        """The git blob id: of the LFS pointer for LFS files, of the content otherwise."""
        if self.lfs:
            return git_blob_sha1(self.pointer)
        return git_blob_sha1(self.blob.read())

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid


@dataclass
class Repo:
    repo_id: str
    spec: dict
    files: dict[str, RepoFile] = field(default_factory=dict)
    gated_tokens: set[str] = field(default_factory=set)
    params: dict[str, int] = field(default_factory=dict)  # safetensors elements per dtype
    _sha: str | None = None

    @property
    def sha(self) -> str:
        """Deterministic commit id: sha1 over the repo id and each path with its blob id."""
        if self._sha is None:
            lines = [self.repo_id] + [f"{p} {f.oid}" for p, f in sorted(self.files.items())]
            self._sha = hashlib.sha1("\n".join(lines).encode()).hexdigest()
        return self._sha

    def add(self, path: str, blob: Blob, lfs: bool | None = None) -> RepoFile:
        if lfs is None:
            lfs = self._lfs_tracked(path) or blob.size > 10 * 1024 * 1024
        self.files[path] = RepoFile(path, blob, lfs)
        self._sha = None
        return self.files[path]

    def _lfs_tracked(self, path: str) -> bool:
        attributes = self.files.get(".gitattributes")
        text = attributes.blob.read().decode() if attributes else ""
        name = path.rsplit("/", 1)[-1]
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 1 and "filter=lfs" in parts[1:]:
                pattern = parts[0]
                if fnmatch.fnmatch(path, pattern) or (
                    "/" not in pattern and fnmatch.fnmatch(name, pattern)
                ):
                    return True
        return False


# --------------------------------------------------------------------------- building repos


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _tensor_dtypes(name: str, kind: str, quant: str) -> list[tuple[str, str, str]]:
    """(tensor name, dtype, size class) for one checkpoint entry; scales come with weights."""
    if kind == "norm":
        return [(name, "BF16", "norm")]
    if kind == "bias":
        return [(name, "F32", "vector")]
    if quant == "fp8" and kind in ("linear", "expert", "mtp"):
        return [(name, "F8_E4M3", "big"), (name + "_scale_inv", "F32", "scale")]
    if quant == "nvfp4" and kind == "expert":
        return [
            (name, "U8", "big"),
            (name + "_scale", "F8_E4M3", "scale"),
            (name + "_scale_2", "F32", "scalar"),
            (name.removesuffix("weight") + "input_scale", "F32", "scalar"),
        ]
    return [(name, "BF16", "big")]


def _shape(size_class: str, dtype: str, big_bytes: int) -> list[int]:
    if size_class == "norm":
        return [512]
    if size_class == "vector":
        return [256]
    if size_class == "scale":
        return [16, 16]
    if size_class == "scalar":
        return []
    cols = 512
    return [max(1, big_bytes // (cols * DTYPE_SIZE[dtype])), cols]


def safetensors_shard(seed: str, tensors: list[tuple[str, str, str]], target: int):
    """A valid safetensors file of about ``target`` bytes: (blob, {name: (dtype, shape)})."""
    n_big = sum(1 for _, _, size_class in tensors if size_class == "big") or 1
    big_bytes = max(1024, target // n_big)
    header: dict = {"__metadata__": {"format": "pt"}}
    layout = {}
    offset = 0
    for name, dtype, size_class in tensors:
        shape = _shape(size_class, dtype, big_bytes)
        nbytes = DTYPE_SIZE[dtype]
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        layout[name] = (dtype, shape)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return SyntheticBlob(seed, offset, struct.pack("<Q", len(raw)) + raw), layout


def load_specs(data_dir: Path = DATA_DIR) -> tuple[dict, dict]:
    data = json.loads((data_dir / "repos.json").read_text())
    specs = data["repos"]
    for repo_id, spec in specs.items():
        base_id = spec.get("base")
        if base_id:
            base = specs[base_id]
            merged = {k: v for k, v in base.items() if k not in ("config_update", "extra_json")}
            merged.update(spec)
            merged["base_model"] = spec.get("base_model", base_id)
            config = copy.deepcopy(base["config"])
            for key, value in spec.get("config_update", {}).items():
                if value is None:
                    config.pop(key, None)
                else:
                    config[key] = value
            merged["config"] = config
            specs[repo_id] = merged
    return specs, data["tensors"]


def _readme(repo_id: str, spec: dict) -> bytes:
    kind = "model" if spec.get("real") else "placeholder"
    lines = ["---", f"license: {spec['license']}", "library_name: transformers"]
    lines.append(f"pipeline_tag: {spec['pipeline_tag']}")
    if spec.get("base_model"):
        lines += ["base_model:", f"- {spec['base_model']}"]
    lines += ["tags:"] + [f"- {tag}" for tag in spec["tags"]] + ["---", ""]
    lines += [
        f"# {repo_id.split('/')[1]} (gpufleet lab {kind})",
        "",
        spec["summary"],
        "",
        "This repository is served by the gpufleet lab mirror. The configuration and",
        "tokenizer files are real-looking metadata; the safetensors shards hold a few",
        "placeholder tensors with synthetic bytes. Do not load them as model weights.",
        "",
    ] if not spec.get("real") else [
        "This repository is served by the gpufleet lab mirror: a real model of random",
        "weights that an engine loads and runs (its answers mean nothing), with the GLM",
        "tokenizer and chat template of the lab's placeholder checkpoints.",
        "",
    ]
    return "\n".join(lines).encode()


def _llama_tensors(config: dict) -> dict[str, list[int]]:
    """Every tensor of a LlamaForCausalLM checkpoint of ``config``'s sizes, with its shape."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    out = {"model.embed_tokens.weight": [config["vocab_size"], hidden],
           "model.norm.weight": [hidden], "lm_head.weight": [config["vocab_size"], hidden]}
    for layer in range(config["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        out.update({
            pre + "input_layernorm.weight": [hidden],
            pre + "post_attention_layernorm.weight": [hidden],
            pre + "self_attn.q_proj.weight": [q, hidden],
            pre + "self_attn.k_proj.weight": [kv, hidden],
            pre + "self_attn.v_proj.weight": [kv, hidden],
            pre + "self_attn.o_proj.weight": [hidden, q],
            pre + "mlp.gate_proj.weight": [inter, hidden],
            pre + "mlp.up_proj.weight": [inter, hidden],
            pre + "mlp.down_proj.weight": [hidden, inter],
        })
    return out


def _bf16(values: list[float]) -> bytes:
    """Little-endian bfloat16 of ``values`` (each float32 cut to its upper 16 bits)."""
    bits = array("I")
    bits.frombytes(array("f", values).tobytes())
    halves = array("H", (b >> 16 for b in bits))
    if sys.byteorder == "big":
        halves.byteswap()
    return halves.tobytes()


def real_weights(seed: str, config: dict) -> tuple[BytesBlob, dict[str, list[int]]]:
    """A loadable safetensors file of random weights for ``config`` (deterministic from
    ``seed``): norms 1, every other tensor normal with standard deviation 0.02."""
    rng = random.Random(seed)
    header: dict = {"__metadata__": {"format": "pt"}}
    data = []
    offset = 0
    tensors = _llama_tensors(config)
    for name in sorted(tensors):
        count = math.prod(tensors[name])
        values = [1.0] * count if name.endswith("norm.weight") else \
            [rng.gauss(0.0, 0.02) for _ in range(count)]
        data.append(_bf16(values))
        header[name] = {"dtype": "BF16", "shape": tensors[name],
                        "data_offsets": [offset, offset + 2 * count]}
        offset += 2 * count
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return BytesBlob(struct.pack("<Q", len(raw)) + raw + b"".join(data)), tensors


def build_real_repo(repo_id: str, spec: dict) -> Repo:
    """A small model a real engine loads and runs (``spec["real"]``): a Llama decoder of
    the spec's config with random weights in one safetensors file, and the placeholder
    checkpoints' GLM tokenizer and chat template (its vocabulary is the config's)."""
    repo = _repo_with_metadata(repo_id, spec)
    blob, tensors = real_weights(repo_id, spec["config"])
    repo.add("model.safetensors", blob)
    repo.params["BF16"] = sum(math.prod(shape) for shape in tensors.values())
    return repo


def _repo_with_metadata(repo_id: str, spec: dict) -> Repo:
    """A repo with the files besides the weights: .gitattributes, README, config, the
    generation config and the tokenizer's two files."""
    repo = Repo(repo_id, spec)
    repo.add(".gitattributes", BytesBlob((DATA_DIR / "gitattributes").read_bytes()))
    repo.add("README.md", BytesBlob(_readme(repo_id, spec)))
    repo.add("config.json", BytesBlob(_json_bytes(spec["config"])))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        repo.add(name, BytesBlob((DATA_DIR / name).read_bytes()))
    return repo


def build_repo(
    repo_id: str, spec: dict, tensor_table: dict, shard_bytes: int | None = None
) -> Repo:
    """Build one repo: a placeholder (``shard_bytes`` overrides the data file's shard
    size), or the real model where the spec says ``real``."""
    if spec.get("real"):
        return build_real_repo(repo_id, spec)
    repo = _repo_with_metadata(repo_id, spec)
    for name, obj in spec.get("extra_json", {}).items():
        repo.add(name, BytesBlob(_json_bytes(obj)))

    family = spec["family"]
    entries = []
    for name, kind in tensor_table[family]:
        entries.append(_tensor_dtypes(name, kind, spec["quant"]))
    n = spec["shards"]
    size = shard_bytes if shard_bytes is not None else spec["shard_kib"] * 1024
    weight_map: dict[str, str] = {}
    total = 0
    per_shard = -(-len(entries) // n)
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        group = [t for entry in entries[i * per_shard : (i + 1) * per_shard] for t in entry]
        target = size if i < n - 1 else max(size // 2, 1024)
        blob, layout = safetensors_shard(f"{repo_id}/{fname}", group, target)
        repo.add(fname, blob)
        for tname, (dtype, shape) in layout.items():
            weight_map[tname] = fname
            count = 1
            for dim in shape:
                count *= dim
            repo.params[dtype] = repo.params.get(dtype, 0) + count
            total += count * DTYPE_SIZE[dtype]
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    repo.add("model.safetensors.index.json", BytesBlob(_json_bytes(index)))
    return repo


# --------------------------------------------------------------------------- faults, stats


@dataclass
class Cut:
    """Cut GETs of files matching ``glob`` (matched against ``repo_id/path``) at file offset
    ``after_bytes``: the first ``times`` matching GETs whose range holds that byte stop there
    (a GET that resumes there stops at once; a range request for other bytes of the file
    passes untouched and does not count). ``mode`` "close" ends the connection cleanly
    (short body), "reset" sends a TCP RST, "flip" sends the whole body with the byte at
    ``after_bytes`` changed (bytes damaged on the way: a bad proxy, a flaky NIC)."""

    glob: str
    after_bytes: int
    times: int = 1
    mode: str = "close"

    def matches(self, key: str, start: int, end: int) -> bool:
        return (self.times > 0 and start <= self.after_bytes < end
                and fnmatch.fnmatch(key, self.glob))


class Stats:
    def __init__(self):
        self.lock = threading.Condition()
        self.streams = 0  # file bodies being sent now: live state, which reset keeps
        self.reset()

    def reset(self):
        with self.lock:
            self.bytes_sent = 0
            self.requests: dict[str, int] = {}
            self.statuses: dict[str, int] = {}
            self.files: dict[str, dict[str, int]] = {}
            self.cuts = 0
            self.cdn_requests = 0
            self.cdn_requests_with_authorization = 0
            self.max_streams = self.streams  # the most at once since the reset

    def streaming(self, delta: int):
        with self.lock:
            self.streams += delta
            self.max_streams = max(self.max_streams, self.streams)
            self.lock.notify_all()

    def request(self, method: str, path: str, status: int):
        with self.lock:
            key = f"{method} {path}"
            self.requests[key] = self.requests.get(key, 0) + 1
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1

    def file(self, key: str, **counts: int):
        with self.lock:
            entry = self.files.setdefault(key, {"bytes": 0, "gets": 0, "complete": 0, "cut": 0})
            for name, value in counts.items():
                entry[name] += value
            self.bytes_sent += counts.get("bytes", 0)
            self.cuts += counts.get("cut", 0)

    def cdn(self, authorization: bool):
        with self.lock:
            self.cdn_requests += 1
            self.cdn_requests_with_authorization += 1 if authorization else 0

    def snapshot(self, settle: float = 5.0) -> dict:
        """The counts, once no body is being sent (up to ``settle`` seconds): a body is
        counted after its last byte is written, which its client may have read before."""
        with self.lock:
            self.lock.wait_for(lambda: self.streams == 0, timeout=settle)
            return {
                "bytes_sent": self.bytes_sent,
                "cuts": self.cuts,
                "cdn_requests": self.cdn_requests,
                "cdn_requests_with_authorization": self.cdn_requests_with_authorization,
                "max_streams": self.max_streams,
                "files": copy.deepcopy(self.files),
                "requests": dict(self.requests),
                "statuses": dict(self.statuses),
            }


class Bucket:
    """A token bucket of ``rate`` bytes/s that holds nothing: ``take`` books the next free
    slot on the link for its bytes and sleeps (outside the lock) until that slot ends.

    Idle time is not banked, so a short transfer is no faster than the limit and the rate
    measured is the limit; streams sharing a bucket book slots in turn and split it.
    """

    def __init__(self, rate: float):
        self.rate = rate
        self.free_at = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int):
        with self.lock:
            now = time.monotonic()
            self.free_at = max(self.free_at, now) + n / self.rate
            wait = self.free_at - now
        time.sleep(wait)


class RateLimit:
    """Bytes/s for file bodies, shared by all connections of a client address
    (``per="client"``) or one bucket for each TCP connection (``per="connection"``).
    ``mib=0`` is no limit."""

    PER = ("client", "connection")

    def __init__(self, mib: float = 0.0, per: str = "client"):
        self.lock = threading.Lock()
        self.generation = 0
        self.set(mib, per)

    def set(self, mib: float, per: str = "client"):
        if per not in self.PER:
            raise ValueError(f"per must be one of {', '.join(self.PER)}, got {per!r}")
        if not mib >= 0:  # also refuses NaN
            raise ValueError(f"the rate must be >= 0 MiB/s, got {mib}")
        with self.lock:
            self.mib, self.per = float(mib), per
            self.generation += 1  # connections drop their old buckets
            self.clients: dict[str, Bucket] = {}

    @property
    def step(self) -> int:
        """Bytes per write: about 1/20 s of the rate, so the rate is smooth."""
        return max(1024, min(SEND_CHUNK, int(self.mib * MIB / 20)))

    def bucket(self, handler) -> Bucket | None:
        """The bucket for ``handler``'s connection, or None when there is no limit."""
        with self.lock:
            if not self.mib:
                return None
            rate = self.mib * MIB
            if self.per == "client":
                client = handler.client_address[0]
                if client not in self.clients:
                    self.clients[client] = Bucket(rate)
                return self.clients[client]
            mine = getattr(handler, "rate_bucket", None)
            if mine is None or mine[0] != self.generation:
                mine = handler.rate_bucket = (self.generation, Bucket(rate))
            return mine[1]

    def snapshot(self) -> dict:
        with self.lock:
            return {"mib": self.mib, "per": self.per}


# --------------------------------------------------------------------------- HTTP


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, commit: str = ""):
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gpufleet-hfmirror"
    timeout = 120
    mirror: MirrorServer  # set on the per-server subclass

    # ---- logging: method, path, status; never headers, never the query string
    def log_request(self, code="-", size="-"):
        path = urlsplit(getattr(self, "path", "") or "").path
        self.mirror.log(f"{self.command} {path} {getattr(code, 'value', code)}")

    def log_error(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        code = args[0] if args else "?"
        self.mirror.log(f"error {code}")

    def log_message(self, format, *args):  # noqa: A002
        pass

    # ---- plumbing
    def _send(
        self, status: int, body: bytes, headers: dict | None = None, ctype="application/json"
    ):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Request-Id", f"Root={uuid.uuid4().hex}")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.mirror.stats.request(self.command, urlsplit(self.path).path, status)

    def _json(self, obj, status: int = 200):
        self._send(status, json.dumps(obj).encode())

    def _error(self, err: HubError):
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        if err.commit:
            headers["X-Repo-Commit"] = err.commit
        self._send(err.status, json.dumps({"error": err.message}).encode(), headers)

    def _dispatch(self):
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if self.command == "POST" and parts[:1] != ["_admin"]:  # keep the connection in sync
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if parts[:1] == ["_admin"]:
                return self._admin(parts[1:], query)
            if parts[:1] == ["_cdn"] and len(parts) == 2 and self.command in ("GET", "HEAD"):
                return self._cdn(parts[1], query)
            token = self._token()
            if parts[:2] == ["api", "whoami-v2"]:
                if token is None:
                    raise HubError(401, INVALID_CREDENTIALS)
                return self._json(
                    {
                        "type": "user",
                        "name": "lab",
                        "fullname": "gpufleet lab",
                        "auth": {
                            "type": "access_token",
                            "accessToken": {"displayName": "lab", "role": "read"},
                        },
                    }
                )
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = self.mirror.repo(f"{parts[2]}/{parts[3]}", token)
                rest = parts[4:]
                if not rest:
                    return self._model_info(repo, "main", query)
                if rest[0] == "revision" and len(rest) == 2:
                    return self._model_info(repo, rest[1], query)
                if rest[0] == "tree" and len(rest) >= 2:
                    return self._tree(repo, rest[1], "/".join(rest[2:]), query)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = self.mirror.repo(f"{parts[0]}/{parts[1]}", token)
                return self._resolve(repo, parts[3], "/".join(parts[4:]), token)
            raise HubError(404, "Sorry, we can't find the page you are looking for.")
        except HubError as err:
            self._error(err)

    def _token(self) -> str | None:
        """The bearer token, if any; an unknown one is refused like the Hub does."""
        value = self.headers.get("Authorization", "")
        if not value:
            return None
        scheme, _, token = value.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or token not in self.mirror.tokens:
            raise HubError(401, INVALID_CREDENTIALS)
        return token

    def _commit(self, repo: Repo, revision: str) -> str:
        if revision in ("main", repo.sha):
            return repo.sha
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _model_info(self, repo: Repo, revision: str, query: dict):
        sha = self._commit(repo, revision)
        blobs = query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path, f in sorted(repo.files.items()):
            sibling: dict = {"rfilename": path}
            if blobs:
                sibling.update(size=f.size, blobId=f.oid)
                if f.lfs:
                    sibling["lfs"] = {
                        "sha256": f.sha256,
                        "size": f.size,
                        "pointerSize": len(f.pointer),
                    }
            siblings.append(sibling)
        spec = repo.spec
        config = spec["config"]
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "lastModified": LAST_MODIFIED,
            "createdAt": LAST_MODIFIED,
            "private": False,
            "gated": "manual" if repo.gated_tokens else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "library_name": "transformers",
            "tags": ["transformers", "safetensors", *spec["tags"], f"license:{spec['license']}"],
            "pipeline_tag": spec["pipeline_tag"],
            "config": {
                "architectures": config["architectures"],
                "model_type": config["model_type"],
            },
            "cardData": {
                "license": spec["license"],
                "library_name": "transformers",
                "pipeline_tag": spec["pipeline_tag"],
            },
            "siblings": siblings,
            "spaces": [],
            "safetensors": {"parameters": dict(repo.params), "total": sum(repo.params.values())},
            "usedStorage": sum(f.size for f in repo.files.values()),
        }
        self._json(info)

    def _tree(self, repo: Repo, revision: str, prefix: str, query: dict):
        self._commit(repo, revision)
        recursive = query.get("recursive", "").lower() in ("1", "true")
        base = prefix.strip("/") + "/" if prefix.strip("/") else ""
        entries: dict[str, dict] = {}
        for path, f in sorted(repo.files.items()):
            if not path.startswith(base):
                continue
            rel = path[len(base) :].split("/")
            depth = len(rel) if recursive else 1
            for i in range(1, min(depth, len(rel) - 1) + 1):  # folders on the way
                folder = base + "/".join(rel[:i])
                oid = hashlib.sha1(f"{repo.sha}:{folder}".encode()).hexdigest()
                entries.setdefault(
                    folder, {"type": "directory", "oid": oid, "size": 0, "path": folder}
                )
            if len(rel) == 1 or recursive:
                entry = {"type": "file", "oid": f.oid, "size": f.size, "path": path}
                if f.lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(f.pointer)}
                entries[path] = entry
        if base and not entries:
            raise HubError(404, f'{prefix} does not exist on "{revision}"', "EntryNotFound")
        self._json(list(entries.values()))

    def _resolve(self, repo: Repo, revision: str, path: str, token: str | None):
        sha = self._commit(repo, revision)
        if repo.gated_tokens:
            if token is None:
                raise HubError(
                    401,
                    f"Access to model {repo.repo_id} is restricted. You must have access to it "
                    "and be authenticated to access it. Please log in.",
                    "GatedRepo",
                )
            if token not in repo.gated_tokens:
                raise HubError(
                    403,
                    f"Access to model {repo.repo_id} is restricted and you are not in the "
                    f"authorized list. Visit {self.mirror.url}/{repo.repo_id} to ask for access.",
                    "GatedRepo",
                )
        f = repo.files.get(path)
        if f is None:
            raise HubError(404, "Entry not found", "EntryNotFound", commit=sha)
        headers = {"ETag": f'"{f.etag}"', "X-Repo-Commit": sha}
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(f.size)
        if f.lfs and self.mirror.lfs_redirect:
            # As the Hub does: the metadata on the 302 itself, the bytes from another host.
            # The client reads the headers here and must not send its token there.
            headers["Location"] = self._cdn_url(repo, f)
            return self._send(302, b"", headers, ctype="text/plain; charset=utf-8")
        headers["Cache-Control"] = "public, max-age=31536000, immutable" if f.lfs else "no-cache"
        self._serve_file(f, f"{repo.repo_id}/{path}", headers)

    def _cdn_url(self, repo: Repo, f: RepoFile) -> str:
        """An absolute URL to this server under another host name, like a signed CDN URL.

        127.0.0.1 and localhost swap (both reach a loopback listener); other names need
        ``cdn_host``. The file's key rides along so stats and cuts stay per file."""
        # the name and port the client used to reach us (the Host header), else our own
        here = urlsplit("//" + (self.headers.get("Host") or urlsplit(self.mirror.url).netloc))
        port = here.port or self.mirror.address[1]
        host = self.mirror.cdn_host or {"127.0.0.1": "localhost", "localhost": "127.0.0.1"}.get(
            (here.hostname or "").lower(), self.connection.getsockname()[0]
        )
        key = f"{repo.repo_id}/{f.path}"
        expires = 4102444800  # 2100-01-01: fixed, so the URL is deterministic
        signature = hashlib.sha256(f"{f.sha256}:{key}:{expires}".encode()).hexdigest()
        query = f"file={quote(key, safe='')}&expires={expires}&signature={signature}"
        return f"http://{host}:{port}/_cdn/{f.sha256}?{query}"

    def _cdn(self, sha256: str, query: dict):
        """The CDN side: a blob by its SHA-256, no token checked; a request that carries one
        anyway is counted, so tests can show the token never got here."""
        self.mirror.stats.cdn(authorization="Authorization" in self.headers)
        with self.mirror.cut_lock:
            expired = self.mirror.cdn_expired > 0
            self.mirror.cdn_expired -= expired
        if expired:  # as a CDN answers a signed link past its expiry
            raise HubError(403, "Request has expired")
        found = self.mirror.blob(sha256, query.get("file"))
        if found is None:
            raise HubError(404, "Not Found")
        key, f = found
        headers = {"ETag": f'"{f.sha256}"', "Cache-Control": "public, max-age=86400"}
        self._serve_file(f, key, headers)

    def _serve_file(self, f: RepoFile, key: str, headers: dict):
        """Headers, then the body (or the single requested range) of ``f``."""
        start, end, status = 0, f.size, 200
        range_header = self.headers.get("Range")
        if range_header and self.command == "GET" and not self.mirror.ignore_ranges:
            parsed = _parse_range(range_header, f.size)
            if parsed is None:
                raise HubError(416, "Requested Range Not Satisfiable")
            start, end = parsed
            status = 206
        name = f.path.rsplit("/", 1)[-1]
        headers = {
            "Accept-Ranges": "none" if self.mirror.ignore_ranges else "bytes",
            **headers,
            "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";",
        }
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.mirror.stats.request(self.command, urlsplit(self.path).path, status)
        if self.command == "HEAD":
            return
        self.mirror.stats.streaming(1)
        try:
            self._stream(f, key, start, end)
        finally:
            self.mirror.stats.streaming(-1)

    def _stream(self, f: RepoFile, key: str, start: int, end: int):
        cut = self.mirror.take_cut(key, start, end)
        flip = None
        if cut is not None and cut.mode == "flip":
            flip, cut = cut.after_bytes, None
        stop = end if cut is None else min(end, max(start, cut.after_bytes))
        sent = 0
        try:
            for chunk in f.blob.chunks(start, stop):
                at = start + sent
                if flip is not None and at <= flip < at + len(chunk):
                    i = flip - at
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
                for piece in self._paced(chunk):
                    self.wfile.write(piece)
                    sent += len(piece)
        except OSError:  # the client went away
            self.close_connection = True
            self.mirror.stats.file(key, bytes=sent, gets=1)
            return
        if cut is not None and stop < end:
            self.mirror.stats.file(key, bytes=sent, gets=1, cut=1)
            self.close_connection = True
            if cut.mode == "reset":  # RST instead of FIN: close now, with a zero linger
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.connection.close()
            return
        self.mirror.stats.file(key, bytes=sent, gets=1, complete=1 if end == f.size else 0)

    def _paced(self, chunk: bytes):
        """``chunk`` as it may go out: whole without a rate limit, else in small pieces,
        each after its bytes were taken from the bucket (looked up again for every piece,
        so a limit set through the admin endpoint applies to transfers under way)."""
        limit = self.mirror.rate_limit
        if not limit.mib:
            yield chunk
            return
        view = memoryview(chunk)
        pos = 0
        while pos < len(view):
            piece = view[pos : pos + limit.step]
            bucket = limit.bucket(self)
            if bucket is not None:
                bucket.take(len(piece))
            yield piece
            pos += len(piece)

    def _admin(self, parts: list[str], query: dict):
        mirror = self.mirror
        if self.command == "POST" and parts in (["rate"], ["lfs-redirect"]):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))  # keep in sync
        if parts == ["rate"]:
            if self.command == "POST":
                try:
                    mirror.rate_limit.set(float(query.get("mib", 0)), query.get("per", "client"))
                except ValueError as err:
                    raise HubError(400, str(err)) from None
            return self._json(mirror.rate_limit.snapshot())
        if parts == ["lfs-redirect"]:
            if self.command == "POST":
                mirror.lfs_redirect = query.get("on", "1").lower() in ("1", "true", "on", "yes")
            return self._json({"lfs_redirect": mirror.lfs_redirect})
        if self.command == "GET" and parts == ["stats"]:
            return self._json(mirror.stats.snapshot())
        if self.command == "POST" and parts == ["reset"]:
            mirror.stats.reset()
            return self._json({"ok": True})
        if parts == ["faults"]:
            if self.command == "POST":
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"[]")
                mirror.set_cuts([Cut(**item) for item in body])
            elif self.command == "DELETE":
                mirror.set_cuts([])
            return self._json([vars(c) for c in mirror.cuts])
        raise HubError(404, "Unknown admin endpoint")

    do_GET = do_HEAD = do_POST = do_DELETE = _dispatch


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    """One ``bytes=`` range as (start, end-exclusive), or None when not satisfiable."""
    unit, _, spec = value.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            start, end = max(0, size - int(last)), size
        else:
            start = int(first)
            end = min(size, int(last) + 1) if last else size
    except ValueError:
        return None
    if start >= size or start >= end:
        return None
    return start, end


# --------------------------------------------------------------------------- server


class MirrorServer:
    """The mirror, in-process (``start``/``stop`` or a ``with`` block) or from the CLI.

    ``gated`` maps repo id -> accepted token (or a set of tokens); ``tokens`` adds tokens
    that are valid but grant no gated access. ``shard_mib`` sets every weight shard's size
    (the last shard of a repo is half). ``repos`` limits the served repo ids.
    ``rate_limit_mib``/``rate_limit_per`` cap file bodies (see ``RateLimit``; also
    ``set_rate_limit``). ``lfs_redirect`` answers LFS resolves with a 302 to ``/_cdn/``
    under another host name: ``cdn_host``, or by default localhost for 127.0.0.1 and back.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        gated: dict[str, str | set[str]] | None = None,
        tokens: tuple[str, ...] | list[str] = (),
        shard_mib: float | None = None,
        repos: list[str] | None = None,
        cuts: list[Cut] | None = None,
        log_stream: IO[str] | None = None,
        rate_limit_mib: float = 0.0,
        rate_limit_per: str = "client",
        lfs_redirect: bool = False,
        cdn_host: str | None = None,
    ):
        specs, tensor_table = load_specs()
        wanted = repos or list(specs)
        unknown = set(wanted) - set(specs)
        if unknown:
            raise ValueError(f"unknown repo ids: {sorted(unknown)}")
        shard_bytes = int(shard_mib * 1024 * 1024) if shard_mib else None
        self.repos = {rid: build_repo(rid, specs[rid], tensor_table, shard_bytes) for rid in wanted}
        self.tokens: set[str] = set(tokens)
        for repo_id, accepted in (gated or {}).items():
            self.gate(repo_id, accepted)
        self.cuts: list[Cut] = list(cuts or [])
        self.cut_lock = threading.Lock()
        self.stats = Stats()
        self.rate_limit = RateLimit(rate_limit_mib, rate_limit_per)
        self.lfs_redirect = lfs_redirect
        self.cdn_host = cdn_host
        self.ignore_ranges = False  # a server without range support: always the whole file
        self.cdn_expired = 0  # the next N CDN requests: 403, as for a signed link past expiry
        self.log_stream = log_stream if log_stream is not None else sys.stderr
        self.log_lock = threading.Lock()
        handler = type("MirrorHandler", (Handler,), {"mirror": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ---- configuration
    def gate(self, repo_id: str, accepted: str | set[str]):
        accepted = {accepted} if isinstance(accepted, str) else set(accepted)
        self.repos[repo_id].gated_tokens |= accepted
        self.tokens |= accepted

    def add_file(
        self,
        repo_id: str,
        path: str,
        data: bytes | None = None,
        *,
        size: int | None = None,
        lfs: bool | None = None,
    ) -> RepoFile:
        """Register an extra file: given bytes, or ``size`` deterministic synthetic bytes."""
        blob = (
            BytesBlob(data) if data is not None else SyntheticBlob(f"{repo_id}/{path}", size or 0)
        )
        return self.repos[repo_id].add(path, blob, lfs)

    def set_rate_limit(self, mib: float, per: str = "client"):
        """``mib`` MiB/s per client address or per connection; 0 removes the limit."""
        self.rate_limit.set(mib, per)

    def set_cuts(self, cuts: list[Cut]):
        with self.cut_lock:
            self.cuts = list(cuts)

    def take_cut(self, key: str, start: int, end: int) -> Cut | None:
        with self.cut_lock:
            for cut in self.cuts:
                if cut.matches(key, start, end):
                    cut.times -= 1
                    return cut
        return None

    # ---- lookups
    def repo(self, repo_id: str, token: str | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            if token is None:
                raise HubError(401, "Repository not found", "RepoNotFound")
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def blob(self, sha256: str, key: str | None = None) -> tuple[str, RepoFile] | None:
        """(``repo_id/path``, file) of an LFS file with this SHA-256: the one named by
        ``key`` if it matches (repos share some files), else the first found."""
        found = None
        for repo_id, repo in self.repos.items():
            for path, f in repo.files.items():
                if f.lfs and f.sha256 == sha256:
                    if key in (None, f"{repo_id}/{path}"):
                        return f"{repo_id}/{path}", f
                    found = found or (f"{repo_id}/{path}", f)
        return found

    def log(self, line: str):
        with self.log_lock:
            self.log_stream.write(f"hfmirror: {line}\n")
            self.log_stream.flush()

    # ---- lifecycle
    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> MirrorServer:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="hfmirror", daemon=True
        )
        self._thread.start()
        return self

    def stop(self):
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def serve_forever(self):
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()

    def __enter__(self) -> MirrorServer:
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _pair(text: str, sep: str = "=") -> tuple[str, str]:
    key, found, value = text.partition(sep)
    if not found or not key or not value:
        raise argparse.ArgumentTypeError(f"expected KEY{sep}VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpufleet_lab.hfmirror", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument(
        "--gated",
        action="append",
        type=_pair,
        default=[],
        metavar="REPO=TOKEN",
        help="gate REPO; TOKEN is accepted for it (repeatable)",
    )
    p.add_argument(
        "--token",
        action="append",
        default=[],
        help="a valid token without gated access (repeatable)",
    )
    p.add_argument(
        "--shard-mib",
        type=float,
        default=None,
        help="size of each weight shard in MiB (default: small, from the data file)",
    )
    p.add_argument("--repo", action="append", default=None, help="serve only these repo ids")
    p.add_argument(
        "--extra-file",
        action="append",
        default=[],
        metavar="REPO:PATH=MIB",
        help="register a synthetic LFS file of MIB MiB (repeatable)",
    )
    p.add_argument(
        "--cut-path",
        default=None,
        metavar="GLOB",
        help="cut GETs of files matching GLOB (against REPO/PATH)",
    )
    p.add_argument(
        "--cut-after-bytes",
        type=int,
        default=0,
        metavar="N",
        help="file offset where cut transfers stop",
    )
    p.add_argument(
        "--cut-times", type=int, default=1, metavar="K", help="cut the first K matching GETs"
    )
    p.add_argument("--cut-mode", choices=("close", "reset"), default="close")
    p.add_argument(
        "--rate-limit-mib",
        type=float,
        default=0.0,
        metavar="R",
        help="send file bodies at most R MiB/s (default 0: no limit)",
    )
    p.add_argument(
        "--rate-limit-per",
        choices=RateLimit.PER,
        default="client",
        help="client: one limit shared by all connections from a client address (default); "
        "connection: one for each TCP connection",
    )
    p.add_argument(
        "--lfs-redirect",
        action="store_true",
        help="answer LFS resolves with a 302 to /_cdn/ on another host name, as the Hub does",
    )
    p.add_argument(
        "--cdn-host",
        default=None,
        metavar="NAME",
        help="host name in the redirects (default: localhost for 127.0.0.1 and back, "
        "else this server's address)",
    )
    args = p.parse_args(argv)
    if not args.rate_limit_mib >= 0:
        p.error("--rate-limit-mib must be >= 0")

    gated: dict[str, set[str]] = {}
    for repo_id, token in args.gated:
        gated.setdefault(repo_id, set()).add(token)
    cuts = []
    if args.cut_path:
        cuts.append(Cut(args.cut_path, args.cut_after_bytes, args.cut_times, args.cut_mode))
    mirror = MirrorServer(
        args.host,
        args.port,
        gated=gated,
        tokens=args.token,
        shard_mib=args.shard_mib,
        repos=args.repo,
        cuts=cuts,
        rate_limit_mib=args.rate_limit_mib,
        rate_limit_per=args.rate_limit_per,
        lfs_redirect=args.lfs_redirect,
        cdn_host=args.cdn_host,
    )
    for item in args.extra_file:
        target, mib = _pair(item)
        repo_id, path = target.rsplit(":", 1)
        mirror.add_file(repo_id, path, size=int(float(mib) * 1024 * 1024), lfs=True)
    mirror.log(f"serving {len(mirror.repos)} repos on {mirror.url}")
    with contextlib.suppress(KeyboardInterrupt):
        mirror.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

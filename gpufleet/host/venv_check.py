#!/usr/bin/env python3
"""What an engine venv holds against its lock, and whether a host's Python can make one.

    <engine venv>/bin/python venv_check.py --lock <venv>/requirements.lock
    python3.X venv_check.py --host
    python3 venv_check.py --image        (inside an engine image's container)

``--lock FILE``, run with the Python of the engine's venv: the distributions that venv
has installed (``importlib.metadata``) against the lock's ``NAME==VERSION`` lines (names
compared normalized, PEP 503). Output: ``{"locked": number of locked names, "wrong":
["NAME==LOCKED (the venv has VERSION or nothing)", ...] sorted, "flashinfer":
{"flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache": installed version or
null}}``.

``--host``, run with the host's Python that is to make the venv (``python3.X``): what
``python3.X -m venv`` needs. Output: ``{"glibc": "2.36" (empty where the C library is
not glibc), "venv": importable, "ensurepip": importable}``.

``--image``, run with the Python of an engine image, in a container started as the plan
starts the engine's: the FlashInfer family installed in the image, and what the container
sees of RDMA. Output: ``{"flashinfer": {...as above}, "uverbs": ["uverbs0", ...] (the
verbs devices under /dev/infiniband), "ipc_lock": CAP_IPC_LOCK is effective}``.

Output goes to stdout as one line of JSON; the caller judges it (roles/engine_runtime:
the lock's wrong packages, the FlashInfer floor, the glibc floor). Exit status: 0 the
answer is on stdout (whatever it says), 2 the lock cannot be read (the error on stderr).

Stdlib only; runs on Python 3.8 to 3.13.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from importlib import metadata

FLASHINFER = ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
# a lock's requirement line: ``NAME==VERSION \`` (its --hash lines and comments follow)
LOCK_LINE = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")


def norm(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict:
    """Normalized name -> version of every distribution this Python sees (the first one
    on sys.path wins, as for an import)."""
    have = {}
    for dist in metadata.distributions():
        have.setdefault(norm(dist.metadata["Name"] or ""), dist.version)
    return have


def read_lock(path: str) -> dict:
    """Normalized name -> locked version."""
    locked = {}
    with open(path) as lock:
        for line in lock:
            m = LOCK_LINE.match(line)
            if m:
                locked[norm(m.group(1))] = m.group(2)
    return locked


def against_lock(locked: dict, have: dict) -> dict:
    return {
        "locked": len(locked),
        "wrong": sorted(f"{name}=={version} (the venv has {have.get(name) or 'nothing'})"
                        for name, version in locked.items() if have.get(name) != version),
        "flashinfer": {name: have.get(name) for name in FLASHINFER},
    }


def glibc() -> str:
    """glibc's version ("2.36"), or "" where the C library is not glibc."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").split(" ")[-1]
    except (ValueError, OSError):  # a C library without the name (musl)
        return ""


def host() -> dict:
    out = {"glibc": glibc()}
    for module in ("venv", "ensurepip"):
        try:
            __import__(module)
            out[module] = True
        except ImportError:
            out[module] = False
    return out


CAP_IPC_LOCK = 14


def image(dev: str = "/dev/infiniband", status: str = "/proc/self/status") -> dict:
    try:
        uverbs = sorted(n for n in os.listdir(dev) if n.startswith("uverbs"))
    except OSError:
        uverbs = []
    cap_eff = 0
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    cap_eff = int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    have = installed()
    return {"flashinfer": {name: have.get(name) for name in FLASHINFER}, "uverbs": uverbs,
            "ipc_lock": bool(cap_eff >> CAP_IPC_LOCK & 1)}


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--lock", metavar="FILE", help="the venv's installed distributions "
                      "against this lock (run with the venv's Python)")
    mode.add_argument("--host", action="store_true", help="glibc, venv and ensurepip of "
                      "this Python")
    mode.add_argument("--image", action="store_true", help="FlashInfer and the RDMA "
                      "devices and capability this container sees")
    opts = ap.parse_args(argv)
    if opts.host:
        answer = host()
    elif opts.image:
        answer = image()
    else:
        try:
            locked = read_lock(opts.lock)
        except (OSError, UnicodeDecodeError) as exc:
            print(f"venv_check: cannot read the lock {opts.lock}: {exc}", file=sys.stderr)
            return 2
        answer = against_lock(locked, installed())
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Build the lab's ai-dynamo 1.6.1 wheel: upstream's wheel with ``dynamo.vllm`` swapped.

    lab/dynamo/build.py --out DIR [--upstream PATH]

Reads upstream's ``ai_dynamo-1.6.1-py3-none-any.whl`` (from --upstream, a wheel or a
folder, default DIR, where fetch_wheels.sh put it) and writes
``ai_dynamo-1.6.1-1lab-py3-none-any.whl`` into DIR. Same distribution name and version;
the build tag ``1lab`` marks it and makes pip prefer it over upstream's file in the same
wheel source. Changes, nothing else:

* ``dynamo/vllm/`` is replaced by the lab shim (``shim/``) plus a copy of
  ``gpufleet/engine_flags.py`` and the two option tables it needs, and the stand-in
  model (``lab/standins/gpufleet_standin/model.py`` + ``standin.json``) as
  ``dynamo/vllm/_standin/``;
* Requires-Dist drops aisimulate (not on PyPI), transformers and kubernetes (unused by
  the frontend and the mocker in the lab) and adds packaging and pyyaml (imported by the
  frontend, upstream gets them through transformers);
* entry points that name upstream's ``dynamo.vllm`` modules are dropped;
* RECORD is rewritten. Offline, stdlib only, deterministic (fixed timestamps).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NAME, VERSION, BUILD = "ai_dynamo", "1.6.1", "1lab"
UPSTREAM = f"{NAME}-{VERSION}-py3-none-any.whl"
OUTPUT = f"{NAME}-{VERSION}-{BUILD}-py3-none-any.whl"
DIST_INFO = f"{NAME}-{VERSION}.dist-info"
# what engine_flags reads for `dynamo.vllm`: the tables it merges and the flags it leaves out
TABLES = ("dynamo-1.6.1-vllm-worker-flags.json", "vllm-0.31.0-serve-flags.json",
          "vllm-0.31.0-frontend-flags.json")
DROP_REQUIRES = ("aisimulate", "transformers", "kubernetes")
ADD_REQUIRES = ("packaging>=24", "pyyaml>=6")
STAMP = (2026, 1, 1, 0, 0, 0)
STANDIN_DIR = REPO / "lab" / "standins" / "gpufleet_standin"
STANDIN = ("model.py", "standin.json")
# model.py only needs DATA from the stand-ins' settings module (which also checks argv).
STANDIN_SETTINGS = b"""\"\"\"DATA of the lab stand-in model (vendored subset of settings.py).\"\"\"

import json
from pathlib import Path

DATA = json.loads((Path(__file__).parent / "standin.json").read_text())
"""


def shim_files() -> dict[str, bytes]:
    """arcname -> content of the lab's dynamo/vllm package."""
    files = {f"dynamo/vllm/{p.name}": p.read_bytes() for p in sorted((HERE / "shim").glob("*.py"))}
    # The stand-in model (what the vLLM/SGLang stand-ins answer) and its canned text.
    for name in STANDIN:
        files[f"dynamo/vllm/_standin/{name}"] = (STANDIN_DIR / name).read_bytes()
    files["dynamo/vllm/_standin/__init__.py"] = b'"""The lab stand-in model (vendored)."""\n'
    files["dynamo/vllm/_standin/settings.py"] = STANDIN_SETTINGS
    files["dynamo/vllm/engine_flags.py"] = (REPO / "gpufleet" / "engine_flags.py").read_bytes()
    tables = REPO / "gpufleet" / "catalog" / "engine-cli"
    for name in TABLES:
        files[f"dynamo/vllm/catalog/engine-cli/{name}"] = (tables / name).read_bytes()
    return files


def patch_metadata(text: str) -> str:
    lines = []
    for line in text.split("\n"):
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            if req.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip() in (
                DROP_REQUIRES
            ):
                continue
        lines.append(line)
    first = next(i for i, line in enumerate(lines) if line.startswith("Requires-Dist:"))
    lines[first:first] = [f"Requires-Dist: {r}" for r in ADD_REQUIRES]
    return "\n".join(lines)


def patch_entry_points(text: str) -> str:
    """Drop entry points into upstream's dynamo.vllm, and sections left empty."""
    sections: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("["):
            sections.append([line])
        elif sections and line.strip() and "dynamo.vllm" not in line.split("=", 1)[-1]:
            sections[-1].append(line)
    return "\n\n".join("\n".join(s) for s in sections if len(s) > 1) + "\n"


def record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def build(upstream: Path, out_dir: Path) -> Path:
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(upstream) as src:
        for info in src.infolist():
            name = info.filename
            if name.startswith("dynamo/vllm/") or name == f"{DIST_INFO}/RECORD":
                continue
            files[name] = src.read(info)
    files.update(shim_files())
    meta = f"{DIST_INFO}/METADATA"
    files[meta] = patch_metadata(files[meta].decode()).encode()
    eps = f"{DIST_INFO}/entry_points.txt"
    files[eps] = patch_entry_points(files[eps].decode()).encode()
    wheel = f"{DIST_INFO}/WHEEL"
    files[wheel] = files[wheel].rstrip(b"\n") + f"\nBuild: {BUILD}\n".encode()
    record = [record_line(n, d) for n, d in sorted(files.items())] + [f"{DIST_INFO}/RECORD,,"]
    files[f"{DIST_INFO}/RECORD"] = ("\n".join(record) + "\n").encode()

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / OUTPUT
    tmp = target.with_suffix(".tmp")
    # dist-info last, as wheel tools write it
    order = sorted(files, key=lambda n: (n.startswith(DIST_INFO), n))
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in order:
            info = zipfile.ZipInfo(name, STAMP)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, files[name])
    tmp.replace(target)
    return target


def find_upstream(path: Path) -> Path:
    wheel = path / UPSTREAM if path.is_dir() else path
    if not wheel.is_file():
        sys.exit(
            f"build.py: upstream wheel {wheel} not found; run "
            f"lab/dynamo/fetch_wheels.sh {path} first"
        )
    return wheel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder to write the wheel into")
    p.add_argument(
        "--upstream",
        type=Path,
        help=f"upstream {UPSTREAM} or the folder holding it (default: --out)",
    )
    args = p.parse_args()
    print(build(find_upstream(args.upstream or args.out), args.out))


if __name__ == "__main__":
    main()

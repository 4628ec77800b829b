#!/usr/bin/env python3
"""Build the lab's stand-in wheels: the engines (vllm, sglang), FlashInfer, and any
other package of an engine lock under its real name and locked version.

    python lab/standins/build.py --out DIR [--flashinfer 0.6.18]
                                         [--flashinfer-cubin VERSION] [NAME==VERSION ...]

Without NAME==VERSION: the dists.json set (vllm and sglang at their default versions,
FlashInfer at --flashinfer). With them: one wheel each, that version; a name dists.json
has gets its shim, any other name a wheel with metadata only (importlib.metadata sees it,
`import` does not), which is how the lab stands in for torch, the CUDA libraries and other
GPU or heavy packages (substitute.json says which; lab/gpufleet_lab/wheels.py builds them for
the lab's locks). Writes py3-none-any wheels.
vllm and sglang vendor the shared core (gpufleet_standin/) as <package>/_standin, with a
copy of gpufleet/engine_flags.py, its flag tables and models.yml as JSON, so a host with
nothing but python3 can run them. The wheels are written directly as zip files (PEP 427):
offline, deterministic and fast; the controller's setuptools (65) cannot build wheels
without the `wheel` package, which is not installed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CORE = HERE / "gpufleet_standin"
DATE = (2026, 1, 1, 0, 0, 0)


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


def package_files(name: str, spec: dict, version: str) -> dict[str, bytes]:
    """{path in wheel: content} for one distribution."""
    files: dict[str, bytes] = {}
    shim = HERE / "shims" / spec["shim"] if spec.get("shim") else None
    for path in sorted(shim.rglob("*.py")) if shim else []:
        text = path.read_text().replace("@VERSION@", version)
        files[path.relative_to(shim).as_posix()] = text.encode()
    vendor = spec.get("vendor")
    if vendor:
        dest = f"{vendor}/_standin"
        for path in sorted(CORE.glob("*.py")) + [CORE / "standin.json", CORE / "metrics.json"]:
            files[f"{dest}/{path.name}"] = path.read_bytes()
        files[f"{dest}/engine_flags.py"] = (REPO / "gpufleet" / "engine_flags.py").read_bytes()
        tables = REPO / "gpufleet" / "catalog" / "engine-cli"
        for path in sorted(tables.iterdir()):
            files[f"{dest}/catalog/engine-cli/{path.name}"] = path.read_bytes()
        models = yaml.safe_load((REPO / "gpufleet" / "catalog" / "models.yml").read_text())
        files[f"{dest}/catalog/models.json"] = json.dumps(models["models"], indent=1).encode()
    return files


def write_wheel(out: Path, name: str, spec: dict, version: str) -> Path:
    norm = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{norm}-{version}.dist-info"
    files = package_files(name, spec, version)
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 f"Summary: {spec['summary']}\nRequires-Python: >=3.9\n"
                                 ).encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: gpufleet-standins-build\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    scripts = spec.get("console_scripts")
    if scripts:
        lines = "".join(f"{k} = {v}\n" for k, v in scripts.items())
        files[f"{info}/entry_points.txt"] = f"[console_scripts]\n{lines}".encode()
    top = sorted({p.split("/")[0] for p in files if not p.startswith(info)})
    files[f"{info}/top_level.txt"] = "".join(f"{t}\n" for t in top).encode()
    record = "".join(f"{p},{_hash(d)},{len(d)}\n" for p, d in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = out / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zinfo = zipfile.ZipInfo(path, DATE)
            zinfo.external_attr = 0o644 << 16
            zinfo.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zinfo, data)
    return wheel


def dists() -> dict[str, dict]:
    data = json.loads((HERE / "dists.json").read_text())
    data.pop("_comment", None)
    return data


def standin(out: Path, name: str, version: str) -> Path:
    """The stand-in wheel of one locked package: its shim if dists.json has one, else
    metadata only."""
    spec = dists().get(name) or {
        "summary": f"gpufleet lab stand-in for {name} {version} (metadata only: no GPU in the lab)"}
    out.mkdir(parents=True, exist_ok=True)
    return write_wheel(out, name, spec, version)


def build(out: Path, flashinfer: str = "0.6.18", flashinfer_cubin: str | None = None
          ) -> list[Path]:
    dists_ = dists()
    options = {"flashinfer": flashinfer, "flashinfer_cubin": flashinfer_cubin or flashinfer}
    out.mkdir(parents=True, exist_ok=True)
    return [write_wheel(out, name, spec, spec["version"] or options[spec["option"]])
            for name, spec in dists_.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the wheels")
    parser.add_argument("--flashinfer", default="0.6.18", help="flashinfer-python version")
    parser.add_argument("--flashinfer-cubin", help="flashinfer-cubin version (default: same)")
    parser.add_argument("pins", nargs="*", metavar="NAME==VERSION", help="one stand-in each")
    args = parser.parse_args(argv)
    wheels = ([standin(args.out, *pin.split("==", 1)) for pin in args.pins] if args.pins
              else build(args.out, args.flashinfer, args.flashinfer_cubin))
    for wheel in wheels:
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fill the lab's wheel source: what lab hosts pip-install, as an air-gapped site would.

- the stand-in engines under the real names and pins (scripts/lab/standins/build.py),
  with FlashInfer at the floor (0.6.18) and one version below it for the faults;
- the real routers from PyPI (vllm-router, sglang-router), the versions the catalog pins;
- Dynamo 1.6.1's wheels and the lab build of ai-dynamo (scripts/lab/dynamo/).

Downloads happen on the controller (which reaches PyPI) once; later runs find the files.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from gpufleet import catalog

from .services import WHEEL_DIR

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "scripts" / "lab" / "standins" / "build.py"
DYNAMO = REPO / "scripts" / "lab" / "dynamo"
FAULT_FLASHINFER = "0.6.16"  # older than the floor: the flashinfer-old fault


class WheelError(Exception):
    pass


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise WheelError(f"lab wheel source: {what} failed: {proc.stderr.strip()[-800:]}")


def _have(project: str, version: str) -> bool:
    stem = project.replace("-", "_")
    return any(WHEEL_DIR.glob(f"{stem}-{version}-*.whl"))


def ensure(log=print) -> None:
    """Make sure every wheel a lab deploy needs is in WHEEL_DIR (idempotent)."""
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    engines = catalog.load().engines
    floor = engines["vllm"].packages["flashinfer-python"]
    _run([py, str(STANDINS), "--out", str(WHEEL_DIR), "--flashinfer", floor], "stand-ins")
    _run([py, str(STANDINS), "--out", str(WHEEL_DIR), "--flashinfer", FAULT_FLASHINFER],
         "stand-ins (fault FlashInfer)")
    # the real routers, and the cache role's huggingface_hub (the controller's pin)
    fetched = [f"{name}=={version}" for e in ("vllm", "sglang")
               for name, version in engines[e].packages.items() if name.endswith("-router")]
    fetched.append(f"huggingface-hub=={metadata.version('huggingface-hub')}")
    missing = [r for r in fetched if not _have(*r.split("=="))]
    if missing:
        log(f"fetching {', '.join(missing)} from PyPI into {WHEEL_DIR}")
        # with their dependencies; the controller is the hosts' platform (bookworm, 3.11)
        _run([py, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
              "-d", str(WHEEL_DIR), *missing], "router download")
    if not _have("ai-dynamo-runtime", engines["dynamo"].packages["ai-dynamo-runtime"]):
        log(f"fetching Dynamo's wheels from PyPI into {WHEEL_DIR} (about 100 MB, once)")
        _run(["bash", str(DYNAMO / "fetch_wheels.sh"), str(WHEEL_DIR)], "Dynamo download")
    _run([py, str(DYNAMO / "build.py"), "--out", str(WHEEL_DIR)], "lab build of ai-dynamo")

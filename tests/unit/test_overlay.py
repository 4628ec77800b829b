"""002's sitecustomize overlay (gpufleet/host/sitecustomize_no_cudnn.py), as the engine
containers' Python loads it. Standard library only: scripts/host-pythons runs it under
every host Python (the image's Python is one of them)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_overlay_turns_cudnn_off_once_torch_is_imported(tmp_path):
    python = sys.executable
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "sitecustomize.py").write_text(
        (REPO / "gpufleet/host/sitecustomize_no_cudnn.py").read_text())
    fake = tmp_path / "site" / "torch"
    (fake / "backends").mkdir(parents=True)
    (fake / "__init__.py").write_text("from . import backends\n")
    (fake / "backends" / "__init__.py").write_text(
        "import types\ncudnn = types.SimpleNamespace(enabled=True)\n")
    env = {**os.environ, "PYTHONPATH": f"{overlay}{os.pathsep}{tmp_path / 'site'}"}
    code = ("import sys; before = 'torch' in sys.modules; import torch; "
            "print(before, torch.backends.cudnn.enabled)")
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]  # not imported early; off once imported
    env["PYTHONPATH"] = str(tmp_path / "site")  # without the overlay: on
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]

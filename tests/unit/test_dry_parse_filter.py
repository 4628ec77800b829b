"""gpufleet_dry_parse_problems: the dry parse's answer as the host's problems."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpufleet/ansible_plugins/filter"))
from dry_parse import dry_parse_problems  # noqa: E402

VENV = "/opt/gpufleet/engines/vllm-0.33.0"


def ran(rc, answer=None, stderr=""):
    return {"rc": rc, "stdout": json.dumps(answer) if answer is not None else "",
            "stderr": stderr}


def test_no_venv_yet_is_no_problem():
    assert dry_parse_problems({"skipped": True}, VENV) == {"problems": [], "other": []}


def test_a_refusal_of_the_plans_version_names_process_engine_message_and_fix():
    answer = {"ok": False, "results": [
        {"name": "prefill", "ok": True, "engine": "vllm", "version": "0.33.0", "error": None},
        {"name": "decode", "ok": False, "engine": "vllm", "version": "0.33.0",
         "error": "vllm serve: error: unrecognized arguments: --max-num-seq"}]}
    out = dry_parse_problems(ran(1, answer), VENV)
    assert out["other"] == []
    (problem,) = out["problems"]
    assert problem.startswith(f"process decode: vllm 0.33.0 in {VENV} refuses its command "
                              "line: vllm serve: error: unrecognized arguments: --max-num-seq")
    assert "Fix: correct or remove that flag" in problem


def test_another_version_in_the_venv_waits_for_prepare():
    answer = {"ok": False, "results": [
        {"name": "decode", "ok": False, "engine": "vllm", "version": "0.31.0", "error": "x"}]}
    assert dry_parse_problems(ran(1, answer), VENV) == {"problems": [], "other": ["decode"]}


def test_a_venv_that_cannot_run_is_named_with_its_fix():
    out = dry_parse_problems(ran(2, None, "Traceback\nImportError: libpython"), VENV)
    (problem,) = out["problems"]
    assert f"could not run with {VENV}/bin/python (exit 2): ImportError: libpython" in problem
    assert "remove it and re-run prepare" in problem


def test_in_an_image_every_engine_is_the_plans_whatever_its_version():
    image = "docker.io/vllm/vllm-openai@sha256:" + "ab" * 32
    answer = {"ok": False, "results": [
        {"name": "prefill", "ok": True, "engine": "vllm", "version": "0.31.2", "error": None},
        {"name": "decode", "ok": False, "engine": "vllm", "version": "0.31.2",
         "error": "vllm serve: error: unrecognized arguments: --max-num-seq"}]}
    out = dry_parse_problems(ran(1, answer), VENV, image)
    assert out["other"] == []
    assert len(out["problems"]) == 1 and f"in {image} refuses" in out["problems"][0]
    broken = dry_parse_problems(ran(125, stderr="Error: crun: no such file"), VENV, image)
    assert "could not run in " + image in broken["problems"][0]
    assert "podman run --rm --entrypoint=python3" in broken["problems"][0]

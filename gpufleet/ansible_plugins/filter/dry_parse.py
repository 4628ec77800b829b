"""Filter gpufleet_dry_parse_problems: what the dry parse's answer means for a host.

The program (gpufleet/host/dry_parse.py) answers one JSON object per run; this turns the
command's result into the problems to report, each with its fix, and the processes whose
venv holds another engine version than the plan's (parsed after prepare replaced it).
"""

from __future__ import annotations

import json

FIX = ("Fix: correct or remove that flag (an override: fab deploy --set ROLE:FLAG=VALUE, or "
       "gpufleet_args in the inventory; docs/overrides.md lists what each engine takes); a "
       "flag the plan renders by itself means the flag table of the pinned engine "
       "(gpufleet/catalog/engine-cli/) disagrees with the installed engine: fix the table")


def dry_parse_problems(result: dict, venv: str, image: str | None = None) -> dict:
    """RESULT is the registered command result (skipped when the venv is not there).
    IMAGE: the parse ran in a container of that image (the image runtime): every engine
    there is the plan's, whatever version it reports."""
    if not result or result.get("skipped"):
        return {"problems": [], "other": []}
    stdout = result.get("stdout") or ""
    try:
        answer = json.loads(stdout) if stdout else {}
    except ValueError:
        answer = {}
    rc = result.get("rc")
    if rc not in (0, 1):
        reason = answer.get("error") or ((result.get("stderr") or "").strip().splitlines()
                                         or [f"exit {rc}"])[-1]
        if image:
            return {"other": [], "problems": [
                f"the dry parse could not run in {image} (exit {rc}): {reason}. Fix: check that "
                f"the image runs on this host (podman run --rm --entrypoint=python3 {image} -V)"]}
        return {"other": [], "problems": [
            f"the dry parse could not run with {venv}/bin/python (exit {rc}): {reason}. Fix: "
            f'check that this venv works ({venv}/bin/python -c "import sys"), or remove it '
            "and re-run prepare"]}
    version = venv.rsplit("-", 1)[-1]
    results = answer.get("results", [])
    ours = [r for r in results if image or r.get("version") == version]
    problems = [f"process {r['name']}: {r['engine']} {r['version']} in {image or venv} refuses "
                f"its command line: {r['error']}. {FIX}" for r in ours if not r.get("ok")]
    other = [r["name"] for r in results
             if not image and r.get("engine") and r.get("version") != version]
    return {"problems": problems, "other": other}


class FilterModule:
    def filters(self):
        return {"gpufleet_dry_parse_problems": dry_parse_problems}

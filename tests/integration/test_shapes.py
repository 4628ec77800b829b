"""Every plan shape deployed: one representative of each shape in tests/shapes.yml (made by
gpufleet/shapes.py over every target and documented option) goes onto the lab with
site.yml, whose verify play proves what a deploy promises (each unit's own process holds
its port, the key is enforced, loopback ports are closed to the controller, no unit
restarts). The test asks again from here, so a verify play that passed a broken promise
fails too: the endpoint refuses a request without the key (or, planned open, serves it)
and serves one with it, and no port the plan keeps on loopback answers.

Shapes another test deploys name it (`by`), and are not deployed twice. The smoke test and
the health checker are left out (the verify play holds the key check; each engine family's
smoke test and the health timer run in test_deploy.py and test_image_runtime.py), and a
shape whose engine this module already prepared on the lab deploys its cache, serve and
verify phases alone (the engine's runtime is the same whatever the shape).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from labutil import ROOT, fab, lab_inventory, playbook, ssh

from gpufleet import catalog as cat
from gpufleet import shapes
from gpufleet_lab import hosts as lab_hosts

pytestmark = pytest.mark.lab

REGISTRY = yaml.safe_load((ROOT / shapes.REGISTRY).read_text())["shapes"]
# the lab profile a target's hardware runs on
PROFILES = {"h200": "h200x8", "gb200": "gb200x4"}
HOSTS = ("lab1", "lab2")


def _params():
    catalog = cat.load()
    entries = [e for e in REGISTRY if not e.get("by")]
    # one lab profile after the other, each family's shapes together (they share its venv)
    order = list(PROFILES)  # the lab's default profile first: it is what runs before

    def key(e):
        target = catalog.targets[shapes.case_of(e["case"]).target]
        return order.index(target.hardware), target.engine

    entries.sort(key=key)
    return [pytest.param(e, id=e["case"], marks=[pytest.mark.slow] if e["slow"] else [])
            for e in entries]


def _inventory(tmp_path: Path, case: shapes.Case) -> str:
    """The lab's inventory with the case's overrides, its groups filled from lab1 then
    lab2 (two hosts where a group needs two: replicas, a two-node engine)."""
    catalog = cat.load()
    target = catalog.targets[case.target]
    groups = dict(catalog.topologies[target.topology].groups)
    if "replicas" in case.variants:
        groups = {g: 2 for g in groups}
    members = {g: list(HOSTS[:n]) if n > 1 else [{"decode": "lab2"}.get(g, "lab1")]
               for g, n in groups.items()}
    ov = shapes.overrides(case, catalog)
    names = {"workers": "gpufleet_workers", "replicas": "gpufleet_replicas",
             "runtime": "gpufleet_runtime", "api_key": "gpufleet_api_key"}
    all_vars = {"gpufleet_target": case.target, **{names[k]: v for k, v in ov.items()}}
    return lab_inventory(tmp_path, all_vars, groups=members)


def _status(url: str, key: str | None = None) -> int | None:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def prepared(_lab_session):
    """What a deploy of this module prepared on each host (lab profile, host, runtime,
    engine, system packages): a later shape that needs nothing else deploys only its
    checkpoint, units and promises (cache, serve, verify)."""
    return set()


def _quiet_health(profile: str) -> None:
    """The lab of this profile up, and the health timer of an earlier deploy stopped: this
    module deploys no health checker (each deploy would restart it), and one left checking
    another shape's units would restart units of the same name under the verify play."""
    lab_hosts.up(hosts=2, profiles=[profile])
    for host in HOSTS:
        ssh(host, "systemctl stop gpufleet-health.timer gpufleet-health.service "
                  "gpufleet-health-watch.service 2>/dev/null; true")


@pytest.mark.parametrize("entry", _params())
def test_the_shape_deploys_and_keeps_its_promises(entry, prepared, tmp_path):
    case = shapes.case_of(entry["case"])
    target = cat.load().targets[case.target]
    profile = PROFILES[target.hardware]
    _quiet_health(profile)
    inv = _inventory(tmp_path, case)
    planned = fab("plan", "-i", inv, "--format", "json")
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    plan = json.loads(planned.stdout)
    # the lab's inventory gives the case's shape (the registry's line), not another
    expected = shapes.shape(shapes.plan_case(case))
    assert expected == entry["shape"], "stale tests/shapes.yml: python -m gpufleet.shapes --write"

    # what prepare makes on each host: its engine runtime and the system packages the plan
    # needs there (etcd for a Dynamo pool), on this profile's lab
    kinds = {(profile, name, req["engine"]["runtime"], req["engine"]["name"],
              tuple(req["system_packages"])) for name, req in plan["hosts"].items()}
    phases = ("--tags", "cache,serve,verify") if kinds <= prepared else \
        ("--skip-tags", "smoke,health")
    run = playbook("-i", inv, "site.yml", *phases)
    prepared.update(kinds)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "Verify | Units | Every unit active, running and not restarted" in run.stdout

    endpoints = plan["endpoints"] or [plan["endpoint"]]
    key = Path(plan["api"]["key_file"]).read_text().strip() \
        if plan["api"]["key_required"] else None
    for endpoint in endpoints:
        bare = _status(endpoint + "/models")
        if key:
            assert bare in (401, 403), f"{endpoint} answered {bare} without the key"
            assert _status(endpoint + "/models", key) == 200, endpoint
        else:
            assert bare == 200, f"{endpoint} (planned open) answered {bare}"
    reached = [p for p in plan["exposure"]["loopback"] if _answers(p["address"], p["port"])]
    assert reached == [], f"loopback ports that answer the controller: {reached}"

"""Every plan shape deployed (those the registry marks `slow` with --slow), and with --slow
every target as well: one representative of each shape in tests/shapes.yml (made by
gpufleet/shapes.py over every target and documented option) goes onto the lab with site.yml,
whose verify play proves what a deploy promises
(each unit's own process holds its port, the key is enforced, loopback ports are closed to
the controller, no unit restarts). The test asks again from here, so a verify play that
passed a broken promise fails too: the endpoint refuses a request without the key (or,
planned open, serves it) and serves one with it, and no port the plan keeps on loopback
answers.

Shapes another test deploys name it (`by`), and are not deployed twice. The smoke test and
the health checker are left out (the verify play holds the key check; each engine family's
smoke test and the health timer run in test_deploy.py and test_image_runtime.py).

The deploys run in lanes: the lab boots two hosts per lane, each lane of one lab profile,
and the lanes deploy side by side, each its cases one after the other (a case of an
engine and runtime its lane already prepared deploys its cache, serve and verify phases
alone, and one whose checkpoints its lane's hosts have fetched its serve and verify phases:
the engine's runtime and the checkpoint are the same whatever the shape). One deploy per
case: each test reads its case's outcome.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from labutil import ROOT, fab, lab_inventory, runner_job, ssh

from gpufleet import catalog as cat
from gpufleet import shapes
from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import hwsim
from gpufleet_lab import images as lab_images

pytestmark = pytest.mark.lab

REGISTRY = yaml.safe_load((ROOT / shapes.REGISTRY).read_text())["shapes"]
SHAPE_OF = {e["case"]: e["shape"] for e in REGISTRY}  # a representative case -> its shape
# the lab profile a target's hardware runs on: the first profile of that hardware (every
# catalog hardware has one: tests/unit/test_lab_profiles.py)
PROFILES: dict[str, str] = {}
for _name in hwsim.PROFILES:
    PROFILES.setdefault(lab_hosts.hardware_of(_name), _name)
# lanes deploying side by side (two lab hosts each; one at least per lab profile the cases
# need); more only queue on the machine's CPUs
LANES = 6
# deploys at once: more lanes than LANES (one per hardware a --slow run needs, nine) take
# turns, so no deploy runs past the lab helpers' 900 s limit only for queueing on the CPUs
# (nine side by side on two cores did)
DEPLOYING = threading.BoundedSemaphore(LANES)
TESTS = ("test_the_shape_deploys_and_keeps_its_promises", "test_every_target_deploys")
# every lane's successful jobs: lane, case, hosts, plan, started, ended (wall clock)
JOBS: list[dict] = []
LANES_RUN: list[int] = []  # the lanes the outcomes fixture started


def _shape_params():
    entries = [e for e in REGISTRY if not e.get("by")]
    return [pytest.param(e["case"], id=e["case"], marks=[pytest.mark.slow] if e["slow"] else [])
            for e in entries]


def _target_params():
    """Every target that is no shape's representative (those deploy as their shape), but a
    lab-only one (lab-cpu: test_lab_cpu*.py deploy it)."""
    return [pytest.param(name, id=name, marks=pytest.mark.slow)
            for name, t in cat.load().targets.items() if name not in SHAPE_OF and not t.lab]


def _hardware(case: shapes.Case) -> str:
    return cat.load().targets[case.target].hardware


def _runtime(case: shapes.Case) -> str:
    catalog = cat.load()
    vendor = catalog.hardware[_hardware(case)].vendor
    return "image" if "image" in case.variants else catalog.runtimes.default[vendor]


def _group(case: shapes.Case) -> tuple[str, str, str]:
    """What a lane prepares once for a case: its hardware, engine and runtime."""
    return _hardware(case), cat.load().targets[case.target].engine, _runtime(case)


def pack(cases: list[shapes.Case], lanes: int = LANES) -> list[list[shapes.Case]]:
    """Cases into about LANES lanes of one hardware each: lanes shared among the
    hardware by their number of cases (one at least per hardware), then the cases of one engine and
    runtime kept together, the largest group first into the lane with the fewest cases."""
    groups: dict[tuple, list[shapes.Case]] = {}
    for case in cases:
        groups.setdefault(_group(case), []).append(case)
    per_hw: dict[str, int] = {}
    for (hw, _, _), members in groups.items():
        per_hw[hw] = per_hw.get(hw, 0) + len(members)
    total = sum(per_hw.values())
    share = {hw: max(1, round(lanes * n / total)) for hw, n in per_hw.items()}
    out: list[list[shapes.Case]] = []
    for hw in sorted(per_hw, key=per_hw.get, reverse=True):
        mine: list[list[shapes.Case]] = [[] for _ in range(share[hw])]
        for key in sorted((k for k in groups if k[0] == hw), key=lambda k: -len(groups[k])):
            min(mine, key=len).extend(groups[key])
        out += [lane for lane in mine if lane]
    return out


def _inventory(tmp_path: Path, case: shapes.Case, hosts: tuple[str, str], lane: int) -> str:
    """The lab's inventory of the lane's two hosts, a deployment of its own (its key, its
    record of the hosts it served), with the case's overrides, its groups
    filled from the first host then the second (two hosts where a group needs two:
    replicas, a two-node engine; decode on the second)."""
    catalog = cat.load()
    target = catalog.targets[case.target]
    groups = dict(catalog.topologies[target.topology].groups)
    if "replicas" in case.variants:
        groups = {g: 2 for g in groups}
    members = {g: list(hosts[:n]) if n > 1 else [hosts[1] if g == "decode" else hosts[0]]
               for g, n in groups.items()}
    ov = shapes.overrides(case, catalog)
    names = {"workers": "gpufleet_workers", "replicas": "gpufleet_replicas",
             "runtime": "gpufleet_runtime", "api_key": "gpufleet_api_key"}
    all_vars = {"gpufleet_target": case.target, "gpufleet_deployment": f"lab-lane{lane}",
                **{names[k]: v for k, v in ov.items()}}
    path = Path(lab_inventory(tmp_path, all_vars, groups=members))
    inventory = yaml.safe_load((path / "hosts.yml").read_text())
    lab = inventory["all"]["children"]["lab"]["hosts"]
    for name in set(lab) - set(hosts):  # the other lanes' hosts are not this deployment's
        del lab[name]
    (path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    return str(path)


def _status(url: str, key: str | None = None, context=None) -> int | None:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
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


def deploy_and_check(case: shapes.Case, hosts: tuple[str, str], lane: int, prepared: set,
                     tmp_path: Path) -> None:
    """Deploy CASE on the lane's HOSTS and prove its promises from the controller; raises
    AssertionError naming what failed."""
    inv = _inventory(tmp_path, case, hosts, lane)
    planned = fab("plan", "-i", inv, "--format", "json")
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    plan = json.loads(planned.stdout)
    if case.name in SHAPE_OF:
        # the lab's inventory gives the case's shape (the registry's line), not another
        assert shapes.shape(shapes.plan_case(case)) == SHAPE_OF[case.name], \
            "stale tests/shapes.yml: python -m gpufleet.shapes --write"

    # what prepare makes on each host: its engine runtime and the system packages the plan
    # needs there (etcd for a Dynamo pool)
    kinds = {(name, req["engine"]["runtime"], req["engine"]["name"],
              tuple(req["system_packages"])) for name, req in plan["hosts"].items()}
    # and what cache fetched for each host: its checkpoints on the shared cache
    fetched = {(name, m["repo"], m["revision"]) for name, req in plan["hosts"].items()
               for m in req["cache"]["models"]}
    phases = ("--skip-tags", "smoke,health") if not kinds <= prepared else \
        ("--tags", "cache,serve,verify") if not fetched <= prepared else \
        ("--tags", "serve,verify")
    # as AWX runs a job: ansible-runner, a private data directory of the job's own
    with DEPLOYING:
        status, rc, output, started, ended = runner_job(tmp_path / "job", inv, *phases)
    assert (status, rc) == ("successful", 0), f"site.yml {' '.join(phases)}:\n" + output[-6000:]
    JOBS.append({"lane": lane, "case": case.name, "hosts": hosts, "plan": plan,
                 "started": started, "ended": ended})
    prepared.update(kinds | fetched)
    assert "Verify | Units | Every unit active, running and not restarted" in output

    endpoints = plan["endpoints"] or [plan["endpoint"]]
    key = Path(plan["api"]["key_file"]).read_text().strip() \
        if plan["api"]["key_required"] else None
    # over TLS as a client reaches it: the certificate verified with the deployment's CA
    tls = plan["api"].get("tls")
    context = ssl.create_default_context(cafile=tls["ca_file"]) if tls else None
    for endpoint in endpoints:
        assert endpoint.startswith("https://" if tls else "http://"), endpoint
        bare = _status(endpoint + "/models", context=context)
        if key:
            assert bare in (401, 403), f"{endpoint} answered {bare} without the key"
            assert _status(endpoint + "/models", key, context) == 200, endpoint
        else:
            assert bare == 200, f"{endpoint} (planned open) answered {bare}"
    reached = [p for p in plan["exposure"]["loopback"] if _answers(p["address"], p["port"])]
    assert reached == [], f"loopback ports that answer the controller: {reached}"


def _lane(number: int, cases: list[shapes.Case], hosts: tuple[str, str], outcomes: dict,
          tmp: Path, say) -> None:
    # a health timer an earlier module left would restart units of the same name under
    # the verify play: this module deploys no health checker
    for host in hosts:
        ssh(host, "systemctl stop gpufleet-health.timer gpufleet-health.service "
                  "gpufleet-health-watch.service 2>/dev/null; true")
    prepared: set = set()
    for case in cases:
        started = time.monotonic()
        work = tmp / case.name
        work.mkdir(parents=True)
        try:
            deploy_and_check(case, hosts, number, prepared, work)
            outcomes[case.name] = None
        except AssertionError as exc:
            outcomes[case.name] = str(exc)
        except Exception:  # noqa: BLE001 (the test names it; the lane goes on)
            outcomes[case.name] = traceback.format_exc()
        verdict = "ok" if outcomes[case.name] is None else "FAILED"
        say(f"lane {number} ({hosts[0]}, {hosts[1]}): {case.name} {verdict} "
            f"({time.monotonic() - started:.0f} s)")


@pytest.fixture(scope="module")
def outcomes(request, _lab_session, tmp_path_factory):
    """Every selected case deployed in lanes: case name -> None (kept its promises) or
    what failed."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", "") in TESTS]
    cases = [shapes.case_of(n) for n in names]
    lanes = pack(cases)
    profiles = [PROFILES[_hardware(lane[0])] for lane in lanes for _ in (0, 1)]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    lock = threading.Lock()

    def say(line: str) -> None:
        """Progress as it happens (the deploys take minutes), past pytest's capture."""
        with lock, capture.global_and_fixture_disabled():
            reporter.write_line(f"shapes: {line}")

    out: dict = {}
    if not lanes:
        return out
    lab_hosts.up(hosts=len(profiles), profiles=profiles)
    engines = sorted({cat.load().targets[c.target].engine for c in cases
                      if _runtime(c) == "image"})
    if engines:
        lab_images.ensure(engines=engines)
    tmp = tmp_path_factory.mktemp("lanes")
    LANES_RUN[:] = list(range(1, len(lanes) + 1))
    say(f"{len(cases)} deploys in {len(lanes)} lanes of "
        f"{', '.join(str(len(lane)) for lane in lanes)}")
    threads = [threading.Thread(target=_lane, args=(i + 1, lane, (f"lab{2 * i + 1}",
                                                                  f"lab{2 * i + 2}"),
                                                    out, tmp, say))
               for i, lane in enumerate(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _verdict(outcomes: dict, name: str) -> None:
    assert name in outcomes, f"{name} was not deployed"
    if outcomes[name] is not None:
        pytest.fail(f"{name}: {outcomes[name]}", pytrace=False)


@pytest.mark.parametrize("name", _shape_params())
def test_the_shape_deploys_and_keeps_its_promises(name, outcomes):
    _verdict(outcomes, name)


@pytest.mark.parametrize("name", _target_params())
def test_every_target_deploys(name, outcomes):
    _verdict(outcomes, name)


def test_the_lanes_jobs_ran_side_by_side_without_interfering(outcomes):
    """A site splits its fleet into deployments (one inventory each) run as parallel jobs
    (docs/awx.md): the lanes' jobs ran at once, and each lane's deployment holds only what
    its own plan put there: its hosts run exactly the units of its last deploy, the
    controller's record of it names only its hosts, and its endpoint refuses another
    deployment's key."""
    if len(LANES_RUN) < 2:
        pytest.skip("fewer than two lanes (a subset of the cases was selected)")
    lanes = sorted({j["lane"] for j in JOBS})
    assert lanes == LANES_RUN, f"lanes {sorted(set(LANES_RUN) - set(lanes))} deployed nothing"
    # at some moment, jobs of two lanes or more were running
    moments = sorted(t for j in JOBS for t in (j["started"], j["ended"]))
    at_once = max(sum(j["started"] <= t < j["ended"] for j in JOBS) for t in moments)
    assert at_once >= 2, [(j["lane"], j["started"], j["ended"]) for j in JOBS]
    last = {lane: [j for j in JOBS if j["lane"] == lane][-1] for lane in lanes}
    keys = {lane: Path(j["plan"]["api"]["key_file"]).read_text().strip()
            for lane, j in last.items() if j["plan"]["api"]["key_required"]}
    assert len(set(keys.values())) == len(keys), "two deployments share a key"
    for lane, job in last.items():
        plan = job["plan"]
        for host in job["hosts"]:
            units = ssh(host, "systemctl list-units --plain --no-legend "
                              "--state=active,activating 'gpufleet-*.service' "
                              "| awk '{print $1}'")
            # the host's own (the lab's hardware, the metrics listener, the health checker)
            mine = {p["unit"] for p in plan["processes"] if p["host"] == host} | {
                "gpufleet-metrics.service", "gpufleet-health-watch.service"}
            theirs = {u for u in units.split() if not u.startswith("gpufleet-lab-")} - mine
            assert theirs == set(), f"lane {lane} ({job['case']}): {host} runs {theirs}"
        record = json.loads(Path(plan["hosts_record"]).read_text())
        assert set(record["hosts"]) <= set(job["hosts"]), (lane, record)
        tls = plan["api"].get("tls")
        context = ssl.create_default_context(cafile=tls["ca_file"]) if tls else None
        for other, key in keys.items():
            if other != lane and plan["api"]["key_required"]:
                endpoint = (plan["endpoints"] or [plan["endpoint"]])[0]
                got = _status(endpoint + "/models", key, context)
                assert got in (401, 403), f"lane {lane} took lane {other}'s key: {got}"

"""A host that fails to prepare, on the lab: one prefill and three decode workers over lab1,
lab2 and lab3 (h200-pd-1node, gpufleet_workers), lab3's engine environment made impossible
to build. Past gpufleet_max_fail_percentage the deploy stops after prepare with no unit
started; within it, lab3 is quarantined: the others serve behind the endpoint, the routers
list only their workers, nothing runs on lab3, and the run ends failed naming it. Mended,
the next deploy puts it back."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from labutil import api_client, endpoint, fab, lab_inventory, main_pids, recap, ssh
from test_scale_out import ask

from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import net

# --slow (about 6 minutes: a lab of three hosts and three deploys); the always-run suite has
# no room for it beside the shapes' deploys
pytestmark = [pytest.mark.lab, pytest.mark.slow]

HOSTS = ("lab1", "lab2", "lab3")


@pytest.fixture(scope="module")
def three(_lab_session, tmp_path_factory):
    try:
        lab_hosts.up(hosts=3)
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab: {exc}", pytrace=False)
    inv = lab_inventory(tmp_path_factory.mktemp("quarantine"),
                        {"gpufleet_target": "h200-pd-1node",
                         "gpufleet_workers": {"prefill": 1, "decode": 3}},
                        groups={"workers": list(HOSTS)})
    yield inv
    assert fab("teardown", "-i", inv).returncode == 0
    lab_hosts.up(hosts=2)  # the next module gets the usual lab


HW = "/etc/gpufleet-lab/hw.json"


def set_fabric_manager(host: str, fm: dict) -> None:
    """The simulated fabric manager's package (what `dpkg-query` and the daemon report)."""
    code = (f"import json; p = {HW!r}; hw = json.load(open(p)); "
            f"hw['fabric_manager'] = {fm!r}; json.dump(hw, open(p, 'w'), indent=2)")
    ssh(host, f"python3 -c {shlex.quote(code)}", check=True)


def routers_workers() -> set[str]:
    """Every worker URL either router on lab1 lists (GET /workers)."""
    urls = set()
    for port in (8000, 8100):
        listing = json.loads(ssh("lab1", f"curl -sf http://127.0.0.1:{port}/workers",
                                 check=True))
        urls |= {w["url"] for w in listing.get("workers", [])}
    return urls


def test_a_host_that_fails_to_prepare_is_quarantined_and_the_others_serve(three):
    inv = three
    plan = json.loads(fab("plan", "-i", inv, "--format", "json").stdout)
    assert "lab3" in plan["hosts"]
    lab3 = f"http://{net.host_address(3)}:8002"
    hw = json.loads(ssh("lab3", f"cat {HW}", check=True))
    set_fabric_manager("lab3", {**hw["fabric_manager"], "version": "580.126.09"})
    all_yml = Path(inv) / "group_vars" / "all.yml"
    values = yaml.safe_load(all_yml.read_text())

    # one host of three is past the default bound (10 %): the run stops after prepare
    proc = fab("deploy", "-i", inv)
    assert proc.returncode != 0
    assert ("lab3 failed prepare (see above): 33.3% of the deployment's hosts, more than "
            "gpufleet_max_fail_percentage (10). The run stops; no unit changed.") in proc.stdout, \
        proc.stdout[-4000:]
    assert all(main_pids(h) == {} for h in HOSTS)

    # within the bound, lab3 is quarantined and the others serve
    all_yml.write_text(yaml.safe_dump({**values, "gpufleet_max_fail_percentage": 34}))
    proc = fab("deploy", "-i", inv)
    assert proc.returncode != 0
    assert "The deployment serves without lab3 (lab3 failed prepare" in proc.stdout, \
        proc.stdout[-4000:]
    counts = recap(proc.stdout)
    assert counts["lab3"]["failed"] >= 1
    assert counts["lab1"]["failed"] == counts["lab2"]["failed"] == 0
    assert main_pids("lab3") == {}
    assert lab3 not in routers_workers() and len(routers_workers()) == 3  # prefill, 2 decode
    client = api_client(endpoint("-i", inv))
    assert all(ask(client, i) for i in range(20))
    # fab status and health act on the hosts that serve
    status = fab("status", "-i", inv)
    assert "lab3" not in status.stdout and "lab2" in status.stdout, status.stdout
    assert "without lab3, which that deploy quarantined" in status.stderr

    # mended, the next deploy puts it back
    set_fabric_manager("lab3", hw["fabric_manager"])
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "gpufleet-decode-2.service" in main_pids("lab3")
    assert lab3 in routers_workers()
    assert all(ask(client, i) for i in range(20))

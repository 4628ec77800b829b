"""SGLang and Dynamo pools on the lab, prefill/decode and aggregated. PD: one prefill
worker on lab1 and two decode workers on lab2 and lab3 behind one router (the real
sglang-router; the real Dynamo frontend, which finds workers through etcd discovery).
Aggregated: two workers on lab1 and lab2 behind the router of the target's pooled form
(sglang-router in its regular mode; the Dynamo frontend with etcd on lab1 instead of the
single-node file discovery). Both workers of the pool take requests, and a rolling restart
restarts each in turn without restarting anything else and loses no request under load:
sglang-router takes each worker out through its worker API and back; a Dynamo worker
leaves the frontend's pool by itself as it stops (it unregisters from discovery on
SIGTERM, then drains) and joins it again as it starts. (vLLM pools: test_scale_out.py.)"""

from __future__ import annotations

import re

import pytest
from labutil import api_client, changed_tasks, endpoint, fab, lab_inventory, main_pids, ssh
from test_scale_out import under_load

from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import net

pytestmark = [pytest.mark.lab, pytest.mark.slow]  # about 5 minutes each: a 3-host lab and a deploy

HOSTS = ("lab1", "lab2", "lab3")
# how many requests a worker finished (its metrics: port, pattern)
SGLANG = (30000, r"^sglang:num_requests_total\{.*\} (\S+)$")
DYNAMO = (9090, r'^dynamo_component_requests_total\{.*dynamo_endpoint="generate".*\} (\S+)$')
PD = {"prefill": ["lab1"], "decode": ["lab2", "lab3"]}
AGG = {"workers": ["lab1", "lab2"]}
# target, served model, the pool's role, the inventory's groups, the workers' metrics
FAMILIES = {
    "sglang-pd": ("sglang-h200-pd", "zai-org/GLM-5.3", "decode", PD, SGLANG),
    "dynamo-pd": ("h200-disagg", "zai-org/GLM-5.3-Flash", "decode", PD, DYNAMO),
    "sglang-agg": ("sglang-h200-low-latency", "zai-org/GLM-5.3", "worker", AGG, SGLANG),
    "dynamo-agg": ("h200-agg", "zai-org/GLM-5.3-Flash", "worker", AGG, DYNAMO),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pool(request, _lab_session, tmp_path_factory):
    family = request.param
    target, _, role, groups, _ = FAMILIES[family]
    try:
        lab_hosts.up(hosts=3)
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab: {exc}", pytrace=False)
    inv = lab_inventory(tmp_path_factory.mktemp(f"{family}-pool"),
                        {"gpufleet_target": target, "gpufleet_workers": {role: 2}},
                        groups=groups)
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    yield family, inv, api_client(endpoint("-i", inv))
    assert fab("teardown", "-i", inv).returncode == 0
    lab_hosts.up(hosts=2)  # the next module gets the usual lab


def workers(family: str) -> dict[str, str]:
    """Each worker's host: the pool's group host by host (the plan's placement)."""
    _, _, role, groups, _ = FAMILIES[family]
    hosts = groups[role if role in groups else "workers"]
    return {host: f"gpufleet-{role}{f'-{i}' if i else ''}.service"
            for i, host in enumerate(hosts)}


def served(family: str, host: str) -> float:
    """Read on the host: a worker beside its router listens on loopback only."""
    port, pattern = FAMILIES[family][4]
    address = net.host_address(int(host[3:]))
    text = ssh(host, f"curl -sf http://127.0.0.1:{port}/metrics || "
                     f"curl -sf http://{address}:{port}/metrics", check=True)
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_both_workers_of_the_pool_take_requests(pool):
    family, _, client = pool
    before = {h: served(family, h) for h in workers(family)}
    proc, results = under_load(client, lambda: None, model=FAMILIES[family][1])
    assert len(results) > 20 and all(results), results.count(False)
    took = {h: served(family, h) - before[h] for h in before}
    assert all(n >= 0.1 * len(results) for n in took.values()), (took, len(results))


def test_a_rolling_restart_restarts_each_worker_in_turn_and_loses_nothing(pool):
    family, inv, client = pool
    role = FAMILIES[family][2]
    before = {h: main_pids(h) for h in HOSTS}
    proc, results = under_load(client, lambda: fab("restart", "--role", role, "-i", inv),
                               model=FAMILIES[family][1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    if family.startswith("sglang"):  # out and back in through the router's worker API
        for host, unit in workers(family).items():  # gpufleet_pool changed: it sent the calls
            moved = [t.split(" | ", 1)[1] for t in changed_tasks(proc.stdout, host)
                     if t.endswith(f"its routers' pools: {unit}")]
            assert moved == [f"Out of its routers' pools: {unit}",
                             f"Back in its routers' pools: {unit}"], (host, moved)
    after = {h: main_pids(h) for h in HOSTS}
    for host, unit in workers(family).items():
        assert after[host][unit] != before[host][unit], (host, unit)
        del after[host][unit], before[host][unit]
    # nothing else was restarted: the router, etcd, the gateway, a prefill worker
    assert after == before
    failed = results.count(False)
    print(f"{family} rolling restart of {role} under load: {failed} of {len(results)} failed")
    assert len(results) > 100 and failed == 0, (failed, len(results))

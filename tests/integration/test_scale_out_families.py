"""SGLang and Dynamo prefill/decode pools on the lab: one prefill worker on lab1 and two
decode workers on lab2 and lab3 behind one router (the real sglang-router; the real Dynamo
frontend, which finds workers through etcd discovery). Both decode workers take requests,
and a rolling restart restarts each in turn without restarting the router and loses no
request under load: sglang-router takes each worker out through its worker API and back;
a Dynamo worker leaves the frontend's pool by itself as it stops (it unregisters from
discovery on SIGTERM, then drains) and joins it again as it starts. (vLLM pools:
test_scale_out.py.)"""

from __future__ import annotations

import re
import urllib.request

import pytest
from labutil import fab, lab_inventory, main_pids
from openai import OpenAI
from test_scale_out import under_load

from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import net

pytestmark = [pytest.mark.lab, pytest.mark.slow]  # about 5 minutes each: a 3-host lab and a deploy

HOSTS = ("lab1", "lab2", "lab3")
FAMILIES = {
    # target, served model, how many requests a decode worker finished (its metrics)
    "sglang": ("sglang-h200-pd", "zai-org/GLM-5.3",
               (30000, r"^sglang:num_requests_total\{.*\} (\S+)$")),
    "dynamo": ("h200-disagg", "zai-org/GLM-5.3-Flash",
               (9090, r'^dynamo_component_requests_total\{.*dynamo_endpoint="generate".*\} '
                      r"(\S+)$")),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pool(request, _lab_session, tmp_path_factory):
    family = request.param
    target, model, _ = FAMILIES[family]
    try:
        lab_hosts.up(hosts=3)
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab: {exc}", pytrace=False)
    inv = lab_inventory(tmp_path_factory.mktemp(f"{family}-pool"),
                        {"gpufleet_target": target, "gpufleet_workers": {"decode": 2}},
                        groups={"prefill": ["lab1"], "decode": ["lab2", "lab3"]})
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = fab("endpoint", "-i", inv, "--format", "env")
    env = dict(line.split("=", 1) for line in out.stdout.split())
    yield family, inv, OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"],
                              max_retries=0, timeout=30)
    assert fab("teardown", "-i", inv).returncode == 0
    lab_hosts.up(hosts=2)  # the next module gets the usual lab


def served(family: str, host: str) -> float:
    port, pattern = FAMILIES[family][2]
    url = f"http://{net.host_address(int(host[3:]))}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return sum(float(v) for v in re.findall(pattern, r.read().decode(), re.M))


def test_both_decode_workers_take_requests(pool):
    family, _, client = pool
    before = {h: served(family, h) for h in ("lab2", "lab3")}
    proc, results = under_load(client, lambda: None, model=FAMILIES[family][1])
    assert len(results) > 20 and all(results), results.count(False)
    took = {h: served(family, h) - before[h] for h in before}
    assert all(n >= 0.1 * len(results) for n in took.values()), (took, len(results))


def test_a_rolling_restart_restarts_each_decode_in_turn_and_loses_nothing(pool):
    family, inv, client = pool
    before = {h: main_pids(h) for h in HOSTS}
    proc, results = under_load(client, lambda: fab("restart", "--role", "decode", "-i", inv),
                               model=FAMILIES[family][1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    said = " ".join(proc.stdout.split())
    if family == "sglang":  # out and back in through the router's worker API
        assert said.count("/workers/{id}") == 2 and said.count("Back in its routers' pools:") == 2
    after = {h: main_pids(h) for h in HOSTS}
    assert after["lab2"]["gpufleet-decode.service"] != before["lab2"]["gpufleet-decode.service"]
    assert after["lab3"]["gpufleet-decode-1.service"] != \
        before["lab3"]["gpufleet-decode-1.service"]
    # the router (and the prefill worker, etcd, the gateway) were not restarted
    assert after["lab1"] == before["lab1"]
    failed = results.count(False)
    print(f"{family} rolling restart of decode under load: {failed} of {len(results)} failed")
    assert len(results) > 100 and failed == 0, (failed, len(results))

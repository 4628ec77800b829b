"""An SGLang prefill/decode pool on the lab: one prefill worker on lab1 and two decode
workers on lab2 and lab3 behind one real sglang-router; a rolling restart takes each decode
worker out through the router's worker API and back, and loses no request under load."""

from __future__ import annotations

import pytest
from labutil import fab, lab_inventory, main_pids
from openai import OpenAI
from test_scale_out import under_load

from gpufleet_lab import hosts as lab_hosts

pytestmark = [pytest.mark.lab, pytest.mark.slow]  # about 5 minutes: a 3-host lab and a deploy

MODEL = "zai-org/GLM-5.3"


@pytest.fixture(scope="module")
def pool(_lab_session, tmp_path_factory):
    try:
        lab_hosts.up(hosts=3)
    except lab_hosts.LabError as exc:
        pytest.fail(f"lab: {exc}", pytrace=False)
    inv = lab_inventory(tmp_path_factory.mktemp("sglang-pool"),
                        {"gpufleet_target": "sglang-h200-pd", "gpufleet_workers": {"decode": 2}},
                        groups={"prefill": ["lab1"], "decode": ["lab2", "lab3"]})
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = fab("endpoint", "-i", inv, "--format", "env")
    env = dict(line.split("=", 1) for line in out.stdout.split())
    yield inv, OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"],
                      max_retries=0, timeout=30)
    assert fab("teardown", "-i", inv).returncode == 0
    lab_hosts.up(hosts=2)  # the next module gets the usual lab


def test_a_rolling_restart_moves_each_decode_through_the_routers_api_and_loses_nothing(pool):
    inv, client = pool
    before = {h: main_pids(h) for h in ("lab1", "lab2", "lab3")}
    proc, results = under_load(client, lambda: fab("restart", "--role", "decode", "-i", inv),
                               model=MODEL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    said = " ".join(proc.stdout.split())
    assert said.count("/workers/{id}") == 2 and said.count("Back in its routers' pools:") == 2
    after = {h: main_pids(h) for h in ("lab1", "lab2", "lab3")}
    assert after["lab2"]["gpufleet-decode.service"] != before["lab2"]["gpufleet-decode.service"]
    assert after["lab3"]["gpufleet-decode-1.service"] != \
        before["lab3"]["gpufleet-decode-1.service"]
    # the router took each worker back through its API: it was not restarted
    assert after["lab1"] == before["lab1"]
    failed = results.count(False)
    print(f"SGLang rolling restart of decode under load: {failed} of {len(results)} failed")
    assert len(results) > 100 and failed == 0, (failed, len(results))

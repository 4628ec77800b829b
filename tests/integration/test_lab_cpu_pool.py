"""The lab target lab-cpu as a pool: two real vLLM engines (the CPU build), one on lab1 and
one on lab2, behind two real vllm-routers and the API gateway (gpufleet_workers:
{worker: 2}). Both take requests; a rolling restart under load (fab restart --role worker)
takes each out of the routers, stops it with the real engine's SIGTERM drain
(--shutdown-timeout), starts it, waits until it is ready by the readiness rule and back in
the pool before the next, and loses no request.

Slow (two 3.5 GB engine installs): ``./scripts/test --slow`` or
``flock /tmp/gpufleet-lab.lock .venv/bin/pytest -s tests/integration/test_lab_cpu_pool.py``.
"""

from __future__ import annotations

import re

import pytest
from labutil import env_client, fab, lab_inventory, main_pids, requests_finished, ssh
from test_scale_out import errors, under_load

from gpufleet_lab import net, wheels

pytestmark = [pytest.mark.lab, pytest.mark.slow]

MODEL = "gpufleet-lab/GLM-5.3-Tiny"
# each worker: its host and its HTTP port (the pooled topology's 8001, on the host's address)
WORKERS = {"worker": ("lab1", 8001), "worker-1": ("lab2", 8001)}
ADDRESS = {f"lab{i}": net.host_address(i) for i in (1, 2)}


def served(worker: str) -> float:
    """Requests the worker finished (the real engine's vllm:request_success_total)."""
    host, port = WORKERS[worker]
    return requests_finished(ADDRESS[host], port)


@pytest.fixture(scope="module")
def pool(lab, tmp_path_factory):
    wheels.ensure_real()
    inv = lab_inventory(tmp_path_factory.mktemp("labcpupool"),
                        {"gpufleet_target": "lab-cpu", "gpufleet_workers": {"worker": 2}},
                        groups={"workers": ["lab1", "lab2"]})
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    yield inv, env_client(inv, timeout=60)
    down = fab("teardown", "-i", inv)
    assert down.returncode == 0, down.stdout[-3000:]


def test_both_real_engines_take_requests_through_one_endpoint(pool):
    _, client = pool
    for host, units in (("lab1", ["worker", "router", "router-1", "gateway"]),
                        ("lab2", ["worker-1"])):
        for unit in units:
            assert ssh(host, f"systemctl is-active gpufleet-{unit}.service").strip() == \
                "active", f"{host}: gpufleet-{unit}.service"
    before = {w: served(w) for w in WORKERS}
    for i in range(8):
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": f"hi {i}"}])
    after = {w: served(w) for w in WORKERS}
    assert all(after[w] > before[w] for w in WORKERS), (before, after)


def test_a_rolling_restart_under_load_loses_nothing_with_the_real_drain(pool):
    inv, client = pool
    before = {h: main_pids(h) for h in ADDRESS}
    proc, results = under_load(client, lambda: fab("restart", "--role", "worker", "-i", inv),
                               model=MODEL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    after = {h: main_pids(h) for h in ADDRESS}
    for host, unit in (("lab1", "worker"), ("lab2", "worker-1")):
        u = f"gpufleet-{unit}.service"
        assert after[host][u] != before[host][u], f"{u} was not restarted"
    # each stopped engine drained: the real engine logs its shutdown timeout's drain
    for host, unit in (("lab1", "worker"), ("lab2", "worker-1")):
        log = ssh(host, f"journalctl -u gpufleet-{unit}.service --no-pager -o cat")
        assert re.search(r"(?i)shutdown|draining", log), log[-2000:]
    failed = results.count(False)
    print(f"rolling restart of two real engines under load: {failed} of {len(results)} "
          "requests failed")
    assert len(results) > 50 and failed == 0, (failed, len(results), errors())

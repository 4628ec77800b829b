"""gpufleet_workers: N prefill and M decode workers behind one router and one endpoint."""

from __future__ import annotations

import pytest

from gpufleet import inventory as inv_mod
from gpufleet.model import PlanError
from gpufleet.plan import make_plan


def hosts(**groups: int) -> inv_mod.Inventory:
    members, all_hosts = {}, {}
    for group, count in groups.items():
        members[group] = []
        for i in range(1, count + 1):
            name = f"{group}-{i}"
            all_hosts[name] = inv_mod.Host(name, f"10.9.{len(all_hosts)}.{i}")
            members[group].append(name)
    return inv_mod.Inventory(hosts=all_hosts, groups=members, source="test")


def flag_values(argv: list[str], flag: str) -> list[list[str]]:
    """The values each occurrence of flag takes (up to the next flag)."""
    out = []
    for i, tok in enumerate(argv):
        if tok == flag:
            vals = []
            for nxt in argv[i + 1:]:
                if nxt.startswith("--"):
                    break
                vals.append(nxt)
            out.append(vals)
    return out


def placed(plan) -> dict[str, tuple[str, list[int], dict]]:
    return {p.name: (p.host, p.gpus, p.ports) for p in plan.processes if p.is_engine}


def test_vllm_two_prefill_two_decode_behind_one_router():
    plan = make_plan("h200-pd-1node", hosts(workers=2),
                     {"workers": {"prefill": 2, "decode": 2}})
    # host by host, a prefill and a decode each, on the single-node layout's GPUs
    assert placed(plan) == {
        "prefill": ("workers-1", [0, 1, 2, 3], {"http": 8001, "nixl": 5557}),
        "prefill-1": ("workers-2", [0, 1, 2, 3], {"http": 8001, "nixl": 5557}),
        "decode": ("workers-1", [4, 5, 6, 7], {"http": 8002, "nixl": 5558}),
        "decode-1": ("workers-2", [4, 5, 6, 7], {"http": 8002, "nixl": 5558})}
    # two routers behind the one gateway (vllm-router takes a worker back only when
    # restarted: a rolling restart restarts them one at a time), each with its own ports
    router, second = plan.by_role("router")
    assert (router.name, router.ports, second.name, second.ports) == (
        "router", {"http": 8000, "metrics": 29000}, "router-1", {"http": 8100, "metrics": 29100})
    for r in (router, second):
        assert flag_values(r.argv, "--prefill") == [["http://10.9.0.1:8001"],
                                                     ["http://10.9.1.2:8001"]]
        assert flag_values(r.argv, "--decode") == [["http://10.9.0.1:8002"],
                                                    ["http://10.9.1.2:8002"]]
        assert r.host == "workers-1" and r.bind == "127.0.0.1"
        assert flag_values(r.argv, "--prometheus-port") == [[str(r.ports["metrics"])]]
    assert [p.role for p in plan.processes].count("gateway") == 1
    assert plan.api["routers"] == ["127.0.0.1:8000", "127.0.0.1:8100"]
    # a rolling restart takes each worker out of both routers by the name they know it by
    decode1 = next(p for p in plan.engines if p.name == "decode-1")
    assert [m["url"] for m in decode1.readiness["pool"]["leave"]] == [
        f"http://127.0.0.1:{port}/remove_worker?url=http%3A%2F%2F10.9.1.2%3A8002"
        for port in (8000, 8100)]
    assert [r["unit"] for r in decode1.readiness["pool"]["routers"]] == [
        "gpufleet-router.service", "gpufleet-router-1.service"]
    assert plan.endpoints == [plan.endpoint] == ["http://10.9.0.1:8000/v1"]
    # KV moves between hosts now: both need RDMA, the engines listen on their address
    assert all(h.rdma for h in plan.hosts.values())
    assert {p.bind for p in plan.engines} == {"10.9.0.1", "10.9.1.2"}
    assert {p.unit for p in plan.engines} == {
        "gpufleet-prefill.service", "gpufleet-prefill-1.service",
        "gpufleet-decode.service", "gpufleet-decode-1.service"}
    # a dead worker leaves the pool within seconds, not the router's default minutes
    assert flag_values(router.argv, "--health-check-interval-secs") == [["2"]]
    assert flag_values(router.argv, "--health-failure-threshold") == [["2"]]


def test_the_pool_health_flags_come_with_a_pool_and_yield_to_an_override():
    (one,) = make_plan("sglang-h200-pd", hosts(prefill=1, decode=1)).by_role("router")
    assert "--health-check-interval-secs" not in one.argv
    (pool,) = make_plan("sglang-h200-pd", hosts(prefill=1, decode=2),
                        {"workers": {"decode": 2},
                         "args": {"router": {"--health-check-interval-secs": 5}}}
                        ).by_role("router")
    assert flag_values(pool.argv, "--health-check-interval-secs") == [["5"]]
    assert flag_values(pool.argv, "--health-check-timeout-secs") == [["2"]]


def test_two_workers_of_a_role_on_one_host_get_their_own_ports():
    plan = make_plan("h200-pd-1node", hosts(workers=2),
                     {"workers": {"prefill": 3, "decode": 1}})
    got = placed(plan)
    assert got["prefill-2"] == ("workers-2", [4, 5, 6, 7], {"http": 8101, "nixl": 5657})
    prefill2 = next(p for p in plan.engines if p.name == "prefill-2")
    assert prefill2.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5657"
    assert "--port" in prefill2.argv and prefill2.argv[prefill2.argv.index("--port") + 1] == \
        "8101"
    assert got["decode"] == ("workers-1", [4, 5, 6, 7], {"http": 8002, "nixl": 5558})


def test_sglang_pd_router_lists_each_prefill_with_its_bootstrap_port():
    plan = make_plan("sglang-h200-pd", hosts(prefill=2, decode=2),
                     {"workers": {"prefill": 2, "decode": 2}})
    (router,) = plan.by_role("router")
    assert flag_values(router.argv, "--prefill") == [["http://10.9.0.1:30000", "8998"],
                                                      ["http://10.9.1.2:30000", "8998"]]
    assert len(flag_values(router.argv, "--decode")) == 2
    # one router, which a rolling restart asks to take a worker out (by its id in GET
    # /workers) and back (a prefill worker with its bootstrap port, as in the flags)
    moves = {p.name: p.readiness["pool"] for p in plan.engines}
    router_url = "http://127.0.0.1:8000"
    assert moves["prefill-1"] == {
        "url": "http://10.9.1.2:30000", "type": "prefill",
        "leave": [{"host": "prefill-1", "method": "DELETE", "body": {},
                   "url": f"{router_url}/workers/{{id}}"}],
        "rejoin": [{"host": "prefill-1", "method": "POST", "url": f"{router_url}/workers",
                    "body": {"url": "http://10.9.1.2:30000", "worker_type": "prefill",
                             "bootstrap_port": 8998}}],
        "routers": [{"host": "prefill-1", "unit": "gpufleet-router.service",
                     "readiness": router.readiness, "workers_url": f"{router_url}/workers"}]}
    assert moves["decode"]["rejoin"][0]["body"] == {"url": "http://10.9.2.1:30000",
                                                    "worker_type": "decode"}
    # moved by the restart itself: no wait for the health check
    assert all("rejoin_s" not in p.readiness for p in plan.engines)


def test_a_pool_with_one_router_that_cannot_take_a_worker_back_waits_for_its_health_check():
    # a vLLM pool without an API key has no gateway, so one vllm-router: nothing moves the
    # worker; the restart waits for the router's health check (2 x 2 s and one interval)
    plan = make_plan("h200-pd-1node", hosts(workers=2),
                     {"workers": {"prefill": 2, "decode": 2}, "api_key": False})
    assert len(plan.by_role("router")) == 1
    assert all("pool" not in p.readiness and p.readiness["rejoin_s"] == 6 for p in plan.engines)


def test_dynamo_workers_are_found_by_discovery_not_listed():
    plan = make_plan("h200-disagg", hosts(prefill=2, decode=3),
                     {"workers": {"prefill": 2, "decode": 3}})
    assert len(plan.by_role("prefill")) == 2 and len(plan.by_role("decode")) == 3
    (router,) = plan.by_role("router")
    assert "--router-mode" in router.argv and "--prefill" not in router.argv
    # a worker leaves the frontend's pool by itself as it stops (Dynamo unregisters it
    # from discovery on SIGTERM): nothing to move, but restarted in turn all the same
    assert all(p.readiness.get("rolling") is True and "pool" not in p.readiness
               and "rejoin_s" not in p.readiness for p in plan.engines)


def test_only_a_pool_of_several_workers_is_restarted_in_turn():
    plan = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"prefill": 1, "decode": 2}})
    assert {p.name: p.readiness.get("rolling", False) for p in plan.processes
            if p.role != "gateway"} == {"prefill": False, "decode": True, "decode-1": True,
                                        "router": True, "router-1": True}
    # one router (SGLang): restarted where it is, there is no other to send to meanwhile
    plan = make_plan("sglang-h200-pd", hosts(prefill=1, decode=2), {"workers": {"decode": 2}})
    assert "rolling" not in plan.by_role("router")[0].readiness
    assert not any("rolling" in p.readiness for p in make_plan(
        "h200-pd-1node", hosts(workers=1)).processes)


def test_without_workers_the_plan_is_unchanged():
    plain = make_plan("h200-pd-1node", hosts(workers=1))
    ones = make_plan("h200-pd-1node", hosts(workers=1), {"workers": {"prefill": 1}})
    assert [(p.name, p.argv, p.env) for p in plain.processes] == \
        [(p.name, p.argv, p.env) for p in ones.processes]


@pytest.mark.parametrize("target, inventory, workers, field, words", [
    ("h200-pd-1node", {"workers": 1}, {"prefill": 2, "decode": 2}, "workers.prefill",
     "2 prefill workers of 4 GPUs each do not fit on the 1 host(s) of [workers]"),
    ("h200-pd-1node", {"workers": 3}, {"prefill": 2, "decode": 2}, "inventory.workers",
     "workers-3 would run no worker"),
    ("h200-pd-1node", {"workers": 2}, {"router": 2}, "workers.router",
     "has no 'router' pool"),
    ("h200-pd-1node", {"workers": 2}, {"prefill": 0}, "workers.prefill", "0 workers"),
    ("sglang-h200-balanced", {"workers": 1}, {"worker": 2}, "workers",
     "not a prefill/decode target behind a router"),
])
def test_counts_that_do_not_fit_are_refused_naming_the_fix(target, inventory, workers, field,
                                                            words):
    with pytest.raises(PlanError) as err:
        make_plan(target, hosts(**inventory), {"workers": workers})
    problems = {p.field: p for p in err.value.problems}
    assert field in problems and words in problems[field].message, err.value
    assert problems[field].fix


def test_workers_and_replicas_together_are_refused():
    with pytest.raises(PlanError, match="gpufleet_workers and gpufleet_replicas are both set"):
        make_plan("h200-pd-1node", hosts(workers=2),
                  {"workers": {"prefill": 2, "decode": 2}, "replicas": True})


def test_a_worker_leaves_its_pool_only_while_another_of_its_kind_is_healthy():
    """The rolling restart's check on each router's GET /workers (vllm-router 0.1.17's
    shape): another healthy worker of the same kind, the worker itself not counted."""
    from gpufleet.ansible_plugins.filter.gpufleet import pool_others

    plan = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"prefill": 2, "decode": 2}})
    pool = next(p for p in plan.engines if p.name == "decode").readiness["pool"]
    listed = [{"url": "http://10.9.0.1:8002", "worker_type": "decode", "is_healthy": True},
              {"url": "http://10.9.1.2:8001", "worker_type": "prefill", "is_healthy": True},
              {"url": "http://10.9.1.2:8002", "worker_type": "decode", "is_healthy": False}]
    assert pool["url"] == "http://10.9.0.1:8002"
    assert pool_others(listed, pool) == 0
    listed[2]["is_healthy"] = True
    assert pool_others(listed, pool) == 1
    assert pool_others(None, pool) == 0


def test_a_worker_is_found_by_its_url_in_the_routers_list():
    """sglang-router 0.3.2's GET /workers gives each worker an id, which DELETE takes."""
    from gpufleet.ansible_plugins.filter.gpufleet import pool_worker_id

    listed = [{"id": "499881b1", "url": "http://127.0.0.1:9001", "worker_type": "prefill"},
              {"id": "b8f5835c", "url": "http://127.0.0.1:9002", "worker_type": "decode"}]
    assert pool_worker_id(listed, "http://127.0.0.1:9002") == "b8f5835c"
    assert pool_worker_id(listed, "http://127.0.0.1:9003") == ""  # out already
    assert pool_worker_id(None, "http://127.0.0.1:9002") == ""


def test_a_pool_call_body_names_only_what_the_plan_knows():
    from pydantic import ValidationError

    from gpufleet.catalog import PoolCall

    assert PoolCall(method="POST", path="/workers", body={"bootstrap_port": "port:bootstrap"})
    with pytest.raises(ValidationError):
        PoolCall(method="POST", path="/workers", body={"url": "{url}"})
    with pytest.raises(ValidationError):
        PoolCall(method="PUT", path="/workers")


def test_the_controller_records_a_deployments_hosts_beside_its_api_key(tmp_path, monkeypatch):
    # one record per inventory (its full path), outside the repository: the next deploy of
    # the same inventory retires the hosts its plan no longer has (playbooks/serve.yml)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    from gpufleet.plan import api_key_path, hosts_record_path
    a, b = hosts_record_path("inv/prod"), hosts_record_path("other/prod")
    assert a.startswith(f"{tmp_path}/gpufleet/deployments/prod-") and a.endswith(".hosts.json")
    assert a != b and hosts_record_path("inv/prod/") == a
    assert api_key_path("inv/prod").startswith(f"{tmp_path}/gpufleet/api-keys/prod-")
    plan = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"decode": 2}})
    assert plan.to_json()["hosts_record"] == plan.hosts_record == hosts_record_path(
        plan.inventory)

"""gpufleet_workers: N prefill and M decode workers behind one router and one endpoint."""

from __future__ import annotations

import re

import pytest

from gpufleet import inventory as inv_mod
from gpufleet.model import PlanError
from gpufleet.plan import make_plan


def ready(p) -> dict:
    """A process's readiness as the plan's JSON gives it to the hosts."""
    return p.to_json()["readiness"]


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
    assert plan.api["upstreams"] == ["127.0.0.1:8000", "127.0.0.1:8100"]
    # a rolling restart takes each worker out of both routers by the name they know it by
    decode1 = next(p for p in plan.engines if p.name == "decode-1")
    assert [m["url"] for m in ready(decode1)["pool"]["leave"]] == [
        f"http://127.0.0.1:{port}/remove_worker?url=http%3A%2F%2F10.9.1.2%3A8002"
        for port in (8000, 8100)]
    assert [r["unit"] for r in ready(decode1)["pool"]["routers"]] == [
        "gpufleet-router.service", "gpufleet-router-1.service"]
    assert plan.endpoints == [plan.endpoint] == ["https://10.9.0.1:8000/v1"]
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
    for pool in make_plan("sglang-h200-pd", hosts(prefill=1, decode=2),
                          {"workers": {"decode": 2},
                           "args": {"router": {"--health-check-interval-secs": 5}}}
                          ).by_role("router"):
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
    routers = plan.by_role("router")
    for router in routers:
        assert flag_values(router.argv, "--prefill") == [["http://10.9.0.1:30000", "8998"],
                                                          ["http://10.9.1.2:30000", "8998"]]
        assert len(flag_values(router.argv, "--decode")) == 2
    # two routers behind the gateway, each of which a rolling restart asks to take a
    # worker out (by its id in its GET /workers) and back (a prefill worker with its
    # bootstrap port, as in the flags)
    moves = {p.name: ready(p)["pool"] for p in plan.engines}
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8100"]
    assert moves["prefill-1"] == {
        "url": "http://10.9.1.2:30000", "type": "prefill",
        "leave": [{"host": "prefill-1", "method": "DELETE", "body": {},
                   "url": f"{url}/workers/{{id}}"} for url in urls],
        "rejoin": [{"host": "prefill-1", "method": "POST", "url": f"{url}/workers",
                    "body": {"url": "http://10.9.1.2:30000", "worker_type": "prefill",
                             "bootstrap_port": 8998}} for url in urls],
        "routers": [{"host": "prefill-1", "unit": r.unit, "readiness": ready(r),
                     "workers_url": f"{url}/workers"}
                    for r, url in zip(routers, urls, strict=True)]}
    assert moves["decode"]["rejoin"][0]["body"] == {"url": "http://10.9.2.1:30000",
                                                    "worker_type": "decode"}
    # moved by the restart itself: no wait for the health check
    assert all("rejoin_s" not in ready(p) for p in plan.engines)


def test_a_pool_with_one_router_that_cannot_take_a_worker_back_waits_for_its_health_check():
    # a vLLM pool without an API key has no gateway, so one vllm-router: nothing moves the
    # worker; the restart waits for the router's health check (2 x 2 s and one interval)
    plan = make_plan("h200-pd-1node", hosts(workers=2),
                     {"workers": {"prefill": 2, "decode": 2}, "api_key": False})
    assert len(plan.by_role("router")) == 1
    assert all("pool" not in ready(p) and ready(p)["rejoin_s"] == 6 for p in plan.engines)


def test_dynamo_workers_are_found_by_discovery_not_listed():
    plan = make_plan("h200-disagg", hosts(prefill=2, decode=3),
                     {"workers": {"prefill": 2, "decode": 3}})
    assert len(plan.by_role("prefill")) == 2 and len(plan.by_role("decode")) == 3
    (router,) = plan.by_role("router")
    assert "--router-mode" in router.argv and "--prefill" not in router.argv
    # a worker leaves the frontend's pool by itself as it stops (Dynamo unregisters it
    # from discovery on SIGTERM): nothing to move, but restarted in turn all the same
    assert all(ready(p).get("rolling") is True and "pool" not in ready(p)
               and "rejoin_s" not in ready(p) for p in plan.engines)


def test_only_a_pool_of_several_workers_is_restarted_in_turn():
    plan = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"prefill": 1, "decode": 2}})
    assert {p.name: ready(p).get("rolling", False) for p in plan.processes
            if p.role != "gateway"} == {"prefill": False, "decode": True, "decode-1": True,
                                        "router": True, "router-1": True}
    # SGLang's two routers too (a new count changes their flags); one without the gateway
    # (no API key) restarts where it is, there is no other to send to meanwhile
    plan = make_plan("sglang-h200-pd", hosts(prefill=1, decode=2), {"workers": {"decode": 2}})
    assert [ready(r).get("rolling") for r in plan.by_role("router")] == [True, True]
    plan = make_plan("sglang-h200-pd", hosts(prefill=1, decode=2),
                     {"workers": {"decode": 2}, "api_key": False})
    assert not ready(plan.by_role("router")[0])["rolling"]
    assert not any(ready(p)["rolling"] for p in make_plan(
        "h200-pd-1node", hosts(workers=1)).processes)


@pytest.mark.parametrize("target, router_flags, port", [
    ("gb200-tray", ["--policy", "round_robin"], 8001),
    ("sglang-h200-low-latency", ["--policy", "round_robin"], 30000),
])
def test_an_aggregated_target_puts_its_workers_behind_one_router(target, router_flags, port):
    """Its topology's pooled form: the workers host by host, a router (its regular mode) in
    front of them all, the one endpoint; every URL after one --worker-urls (nargs *)."""
    plan = make_plan(target, hosts(workers=2), {"workers": {"worker": 2}})
    assert placed(plan) == {"worker": ("workers-1", plan.by_role("worker")[0].gpus,
                                       {"http": port}),
                            "worker-1": ("workers-2", plan.by_role("worker")[1].gpus,
                                         {"http": port})}
    for router in plan.by_role("router"):  # two behind the gateway
        assert flag_values(router.argv, "--worker-urls") == [
            [f"http://10.9.0.1:{port}", f"http://10.9.1.2:{port}"]]
        assert " ".join(router_flags) in " ".join(router.argv)
    assert plan.endpoint == "https://10.9.0.1:8000/v1"
    # a pool over hosts: each worker on its host's internal address
    assert [w.bind for w in plan.by_role("worker")] == ["10.9.0.1", "10.9.1.2"]
    assert all(ready(w)["rolling"] and ready(w)["pool"]["type"] == "regular"
               for w in plan.by_role("worker"))  # as the routers' GET /workers names it
    # one worker: the same form (routers, gateway, the worker's flags), so from 1 to N and
    # back only the routers' worker lists change
    one = make_plan(target, hosts(workers=1), {"workers": {"worker": 1}})
    assert placed(one) == {"worker": placed(plan)["worker"]}
    assert one.endpoint == plan.endpoint and one.api == plan.api
    assert [r.name for r in one.by_role("router")] == [r.name for r in plan.by_role("router")]

    def unlisted(p):
        return [t for t in p.argv if not t.startswith("http://")]
    assert [unlisted(p) for p in one.processes if p.role != "worker"] == \
        [unlisted(p) for p in plan.processes if p.role != "worker"]
    assert flag_values(one.by_role("router")[0].argv, "--worker-urls") == [
        [f"http://10.9.0.1:{port}"]]  # on its address, as with more (no unit moves)
    assert [p.argv for p in one.processes if p.role == "worker"] == \
        [p.argv for p in plan.processes if p.name == "worker"]
    # the policy is the operator's to change
    own = make_plan(target, hosts(workers=2), {"workers": {"worker": 2},
                                               "args": {"router": {"--policy": "cache_aware"}}})
    assert flag_values(own.by_role("router")[0].argv, "--policy") == [["cache_aware"]]


def test_dynamos_aggregated_pool_finds_its_workers_through_etcd():
    """File discovery does not cross hosts: the pooled form runs etcd beside the frontend
    and every process discovers through it."""
    plain = make_plan("h200-agg", hosts(workers=1))
    assert not plain.by_role("etcd") and "DYN_FILE_KV" in plain.by_role("worker")[0].env
    plan = make_plan("h200-agg", hosts(workers=2), {"workers": {"worker": 2}})
    (etcd,), (router,) = plan.by_role("etcd"), plan.by_role("router")
    assert etcd.host == router.host == "workers-1"
    for p in [router, *plan.by_role("worker")]:
        assert flag_values(p.argv, "--discovery-backend") == [["etcd"]], p.name
        assert p.env["ETCD_ENDPOINTS"] == "http://10.9.0.1:2379" and "DYN_FILE_KV" not in p.env
    assert flag_values(router.argv, "--router-mode") == [["round-robin"]]  # 002's for H200
    assert [w.host for w in plan.by_role("worker")] == ["workers-1", "workers-2"]
    assert all(ready(w)["rolling"] and "pool" not in ready(w)
               for w in plan.by_role("worker"))


def test_a_pool_of_one_each_has_the_pooled_form_so_a_count_change_keeps_its_routers():
    # gpufleet_workers at one worker of each role: the routers, gateway and binds of a
    # pool already, so 2 -> 1 or 1 -> 2 changes only the routers' worker lists (measured
    # on SGLang before: 10.7 % of requests failed on 2 -> 1 as the form changed under load)
    plain = make_plan("h200-pd-1node", hosts(workers=1))
    ones = make_plan("h200-pd-1node", hosts(workers=1), {"workers": {"prefill": 1}})
    two = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"decode": 2}})
    assert [p.name for p in plain.processes if p.role == "router"] == ["router"]
    assert [p.name for p in ones.processes if p.role == "router"] == ["router", "router-1"]
    assert [(p.name, p.ports, p.bind) for p in ones.processes if p.role != "decode"] == \
        [(p.name, p.ports, p.bind) for p in two.processes if p.role != "decode"]
    # the engines' own flags are the pool's, the same with one worker as with two
    assert next(p.argv for p in ones.processes if p.role == "prefill") == \
        next(p.argv for p in two.processes if p.role == "prefill")


@pytest.mark.parametrize("target, inventory, workers, field, words", [
    ("h200-pd-1node", {"workers": 1}, {"prefill": 2, "decode": 2}, "workers.prefill",
     "2 prefill workers of 4 GPUs each do not fit on the 1 host(s) of [workers]"),
    ("h200-pd-1node", {"workers": 3}, {"prefill": 2, "decode": 2}, "inventory.workers",
     "workers-3 would run no worker"),
    ("h200-pd-1node", {"workers": 2}, {"router": 2}, "workers.router",
     "has no 'router' pool"),
    ("h200-pd-1node", {"workers": 2}, {"prefill": 0}, "workers.prefill", "0 workers"),
    ("sglang-h200-balanced", {"workers": 1}, {"worker": 2}, "workers.worker",
     "2 worker workers of 8 GPUs each do not fit on the 1 host(s) of [workers]"),
    ("sglang-h200-balanced-bf16", {"workers": 2}, {"worker": 2}, "workers",
     "runs one engine over sglang-agg-2node's hosts with no router in front"),
    ("sglang-h200-balanced", {"workers": 2}, {"decode": 2}, "workers.decode",
     "has no 'decode' pool"),
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


@pytest.mark.parametrize("target, inventory, leave", [
    ("h200-pd-1node", {"workers": 1}, ("POST", "http://127.0.0.1:8000/remove_worker?url={url}")),
    ("sglang-h200-pd", {"prefill": 1, "decode": 1}, ("DELETE", "http://127.0.0.1:8000/workers/{id}")),
])
def test_a_worker_the_plan_drops_leaves_its_routers_pools_first(target, inventory, leave):
    """A lower count: each router's GET /workers against the workers the plan gives it;
    what it lists beyond them is taken out through its API before the worker stops
    (gpufleet_pool, tests/unit/test_pool_module.py)."""
    plan = make_plan(target, hosts(**inventory), {"workers": {"decode": 1}})
    router = plan.by_role("router")[0]
    drop = ready(router)["drop"]
    assert drop["workers_url"] == "http://127.0.0.1:8000/workers"
    assert (drop["leave"]["method"], drop["leave"]["url"]) == leave
    assert drop["leave"]["host"] == router.host
    # the workers beside it by either address (a bind that changes drops none)
    assert drop["keep"] == sorted(
        f"http://{a}:{p.ports['http']}" for p in plan.engines
        for a in ((p.address, "127.0.0.1") if p.host == router.host else (p.address,)))
    # Dynamo's frontend: the workers leave by themselves
    assert "drop" not in ready(make_plan("h200-disagg", hosts(prefill=1, decode=1)).by_role(
        "router")[0])


def test_a_pool_call_body_names_only_what_the_plan_knows():
    from pydantic import ValidationError

    from gpufleet.catalog import PoolCall

    assert PoolCall(method="POST", path="/workers", body={"bootstrap_port": "port:bootstrap"})
    with pytest.raises(ValidationError):
        PoolCall(method="POST", path="/workers", body={"url": "{url}"})
    with pytest.raises(ValidationError):
        PoolCall(method="PUT", path="/workers")


def test_the_controller_names_a_deployment_by_its_inventory_never_by_path_or_home(
        tmp_path, monkeypatch):
    # one record per deployment, outside the repository: the next deploy of the same
    # inventory retires the hosts its plan no longer has (playbooks/serve.yml); another
    # clone, `-i DIR` or `-i DIR/hosts.yml` find the same key and record
    from gpufleet.inventory import Inventory
    from gpufleet.plan import api_key_path, deployment_id, hosts_record_path

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    (tmp_path / "a" / "prod").mkdir(parents=True)
    (tmp_path / "a" / "prod" / "hosts.yml").write_text("all: {}\n")
    (tmp_path / "b" / "prod").mkdir(parents=True)
    (tmp_path / "lab.ini").write_text("")

    def inv(source, **vars):
        return Inventory(hosts={}, groups={}, source=str(source), vars=vars)

    same = [inv(tmp_path / "a" / "prod"), inv(tmp_path / "a" / "prod" / "hosts.yml"),
            inv(f"{tmp_path}/a/prod/"), inv(tmp_path / "b" / "prod")]
    assert {deployment_id(i) for i in same} == {"prod"}
    assert deployment_id(inv(tmp_path / "lab.ini")) == "lab"
    assert deployment_id(inv(tmp_path / "a" / "prod", gpufleet_deployment="prod-eu")) \
        == "prod-eu"
    assert hosts_record_path(same[0]) == f"{tmp_path}/cfg/gpufleet/deployments/prod.hosts.json"
    assert api_key_path(same[1]) == f"{tmp_path}/cfg/gpufleet/api-keys/prod.key"
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert api_key_path(same[0]).endswith("/.config/gpufleet/api-keys/prod.key")
    for bad in ("../x", "a b", "", "x" * 65, 42, "a\nb"):
        with pytest.raises(PlanError, match="gpufleet_deployment"):
            deployment_id(inv(tmp_path, gpufleet_deployment=bad))
    plan = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"decode": 2}})
    assert plan.to_json()["hosts_record"] == plan.hosts_record


@pytest.mark.parametrize("target,groups,line", [
    ("h200-disagg", {"prefill": 1, "decode": 2}, "gpufleet_workers: {decode: 2}"),
    ("sglang-h200-pd", {"prefill": 3, "decode": 1}, "gpufleet_workers: {prefill: 3}"),
    ("sglang-h200-low-latency", {"workers": 2}, "gpufleet_workers: {worker: 2}"),
])
def test_more_hosts_than_the_layout_takes_are_refused_with_the_workers_line(
        target, groups, line):
    """What a user with two decode hosts meant: one worker on each behind the router."""
    with pytest.raises(PlanError, match=re.escape(line)):
        make_plan(target, inv_mod.placeholder(groups))


def batches(plan) -> list[list[str]]:
    """The rolling restart's steps: the names of each batch, in order."""
    steps: dict[int, list[str]] = {}
    for p in plan.processes:
        steps.setdefault(ready(p)["batch"], []).append(p.name)
    assert sorted(steps) == list(range(len(steps))), steps  # every step has a process
    return [steps[k] for k in sorted(steps)]


def test_a_rolling_restart_takes_one_worker_of_a_pool_at_a_time_by_default():
    plan = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"prefill": 2, "decode": 2}})
    # the routers first, alone (a deploy that adds workers gives them their new lists
    # before a worker leaves), then the engines level by level, the k-th worker of each
    # pool together, then the gateway (not rolled by fab restart, but a step of its own)
    assert batches(plan) == [["router"], ["router-1"], ["prefill", "decode"],
                             ["prefill-1", "decode-1"], ["gateway"]]


@pytest.mark.parametrize("max_unavailable, want", [
    (2, [["decode", "decode-1"], ["decode-2", "decode-3"]]),
    ("50%", [["decode", "decode-1"], ["decode-2", "decode-3"]]),
    ("60%", [["decode", "decode-1"], ["decode-2", "decode-3"]]),  # 2.4: rounded down
    ("10%", [["decode"], ["decode-1"], ["decode-2"], ["decode-3"]]),  # at least one
    (9, [["decode", "decode-1", "decode-2"], ["decode-3"]]),  # never the whole pool
    ("100%", [["decode", "decode-1", "decode-2"], ["decode-3"]]),
    ({"decode": 2}, [["decode", "decode-1"], ["decode-2", "decode-3"]]),
    ({"prefill": 2}, [["decode"], ["decode-1"], ["decode-2"], ["decode-3"]]),
])
def test_max_unavailable_takes_that_many_workers_of_a_pool_at_once(max_unavailable, want):
    # four hosts: a prefill and a decode on the first two, a decode on the others
    plan = make_plan("h200-pd-1node", hosts(workers=4),
                     {"workers": {"prefill": 2, "decode": 4}, "max_unavailable": max_unavailable})
    steps = [[n for n in step if n.startswith("decode")] for step in batches(plan)]
    assert [s for s in steps if s] == want
    # a batch's workers run on different hosts (the pool's order goes host by host)
    by_name = {p.name: p.host for p in plan.processes}
    for step in want:
        assert len({by_name[n] for n in step}) == len(step), step


@pytest.mark.parametrize("value, says", [
    (0, "gpufleet_max_unavailable: 0 is neither a count of at least 1"),
    ("0%", "gpufleet_max_unavailable: '0%' is neither"),
    ("101%", "gpufleet_max_unavailable: '101%' is neither"),
    (True, "gpufleet_max_unavailable: True is neither"),
    ("two", "gpufleet_max_unavailable: 'two' is neither"),
    ({"decode": -1}, "gpufleet_max_unavailable.decode: -1 is neither"),
])
def test_a_bad_max_unavailable_is_refused_naming_the_fix(value, says):
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", hosts(workers=2),
                  {"workers": {"prefill": 2, "decode": 2}, "max_unavailable": value})
    assert says in str(err.value) and 'Fix: give a count of workers (e.g. 2)' in str(err.value)


def test_max_unavailable_naming_a_role_the_target_lacks_is_refused():
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", hosts(workers=2),
                  {"workers": {"prefill": 2, "decode": 2}, "max_unavailable": {"worker": 2}})
    assert "max_unavailable.worker: 'worker' is not an engine role of this target. Fix: " \
           "name one of decode, prefill" in str(err.value)


def test_a_target_without_a_pool_restarts_one_process_at_a_time():
    plan = make_plan("h200-pd-1node", hosts(workers=1), {"max_unavailable": 4})
    assert [len(step) for step in batches(plan)] == [1] * len(plan.processes)


def test_the_roll_steps_are_the_batches_of_the_units_to_restart():
    """roles/serve roll.yml's steps (the gpufleet_roll_steps filter) from each host's
    units: only batches that have one, in order, the first the canary; vllm-router's two
    routers restarted once per batch (by the batch's first host), never listed twice."""
    from gpufleet.ansible_plugins.filter.gpufleet import roll_steps
    from gpufleet.model import host_slices

    plan = make_plan("h200-pd-1node", hosts(workers=2), {"workers": {"prefill": 2, "decode": 2}})
    slices = host_slices(plan.to_json())
    hostvars = {h: {"gpufleet_host": s} for h, s in slices.items()}
    hostvars["workers-1"]["__roll_units"] = ["gpufleet-decode.service"]
    hostvars["workers-2"]["__roll_units"] = ["gpufleet-decode-1.service"]
    steps = roll_steps(hostvars, list(hostvars))
    assert [(s["batch"], s["canary"], s["leader"], s["units"]) for s in steps] == [
        (2, True, "workers-1", ["workers-1:gpufleet-decode.service"]),  # after the routers'
        (3, False, "workers-2", ["workers-2:gpufleet-decode-1.service"])]
    assert [[r["unit"] for r in s["routers"]] for s in steps] == \
        [["gpufleet-router.service", "gpufleet-router-1.service"]] * 2
    # nothing to restart: no step; a host that is not asked restarts nothing
    hostvars["workers-2"]["__roll_units"] = []
    del hostvars["workers-1"]["__roll_units"]
    assert roll_steps(hostvars, list(hostvars)) == []


def test_each_worker_of_a_pool_must_hold_the_weights_itself():
    """Four TP2 decode workers are four engines of 2 GPUs each, not one of 8: on H200s
    GLM-5.3-Flash's weights do not fit in 2 GPUs, however many workers there are."""
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", hosts(workers=2),
                  {"workers": {"prefill": 2, "decode": 4},
                   "gpus": {"prefill": [0, 1], "decode": [2, 3]},
                   "args": {"engines": {"--tensor-parallel-size": 2}}})
    assert "decode.memory: zai-org/GLM-5.3-Flash needs" in str(err.value)
    assert "the decode engine has 2 x " in str(err.value)

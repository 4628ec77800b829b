"""gpufleet_quarantine: a deploy leaves out a host that failed before serving where the
plan can do without it (a pool's worker, a whole replica), and refuses where it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet import inventory as inv_mod
from gpufleet.model import PlanError
from gpufleet.plan import make_plan

POOL = {"workers": {"prefill": 1, "decode": 4}}


def placed(plan) -> dict[str, tuple[str, dict]]:
    return {p.name: (p.host, p.ports) for p in plan.processes}


def test_a_pool_workers_host_is_left_out_and_the_others_keep_their_seats():
    inv = inv_mod.placeholder({"workers": 3})
    whole = make_plan("h200-pd-1node", inv, POOL)
    plan = make_plan("h200-pd-1node", inv, {**POOL, "quarantine": ["workers-3"]})
    assert plan.quarantined == ["workers-3"] and plan.to_json()["quarantined"] == ["workers-3"]
    # nothing runs there, and no host slice asks anything of it
    assert not plan.on_host("workers-3") and "workers-3" not in plan.hosts
    # every other process keeps its name, host and ports (its return changes only lists)
    gone = {n for n, (h, _) in placed(whole).items() if h == "workers-3"}
    assert gone == {"decode-2"}
    assert placed(plan) == {n: v for n, v in placed(whole).items() if n not in gone}
    # the routers list the workers that serve, and only them
    for router in plan.by_role("router"):
        assert "http://workers-3:8002" not in router.argv
        assert router.argv.count("--decode") == 3
    assert whole.quarantined == [] and whole.to_json()["quarantined"] == []


def test_a_whole_replica_is_left_out_while_another_serves():
    inv = inv_mod.placeholder({"workers": 3})
    plan = make_plan("h200-pd-1node", inv, {"replicas": True, "quarantine": ["workers-2"]})
    assert {p.host for p in plan.processes} == {"workers-1", "workers-3"}
    assert len(plan.endpoints) == 2 and not any("workers-2" in e for e in plan.endpoints)


@pytest.mark.parametrize("overrides, quarantine, says", [
    # the routers and the gateway run on the first host
    (POOL, ["workers-1"], "quarantine: workers-1 runs router, router-1, which the "
                          "deployment cannot serve without. Fix: fix the host"),
    # the one prefill worker would go with it
    (POOL, ["workers-1"], "quarantine: the prefill pool would keep no worker without "
                          "workers-1"),
    # without a pool (on one host here), every host is needed
    ({}, ["workers-1"], "quarantine: workers-1 runs prefill, decode, router"),
    ({"replicas": True}, ["workers-1", "workers-2", "workers-3"],
     "quarantine: no replica would be left"),
    (POOL, ["workers-9"], "quarantine: workers-9 is not a host of the inventory"),
])
def test_what_the_deployment_cannot_serve_without_is_refused(overrides, quarantine, says):
    inv = inv_mod.placeholder({"workers": 3 if overrides else 1})
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", inv,
                  {**overrides, "quarantine": quarantine})
    assert says in str(err.value)


def test_every_pool_losing_its_last_worker_is_named():
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", inv_mod.placeholder({"workers": 1}),
                  {"workers": {"prefill": 1, "decode": 1}, "quarantine": ["workers-1"]})
    assert "the decode pool would keep no worker" in str(err.value)
    assert "the prefill pool would keep no worker" in str(err.value)


def test_a_deploy_plans_again_from_the_plans_own_inputs_with_the_failed_hosts_left_out():
    """lookup gpufleet_plan with quarantine and the plan's inputs: the same plan as before
    (the command line's overrides included, which the inventory does not hold) but for the
    hosts left out."""
    from ansible.plugins.loader import lookup_loader

    import gpufleet

    names = ["lab1", "lab2", "lab3"]
    hostvars = {h: {"ansible_host": f"10.0.0.{i}", "gpufleet_target": "h200-pd-1node",
                    "gpufleet_workers": POOL["workers"]} for i, h in enumerate(names, 1)}
    variables = {"groups": {"all": names, "ungrouped": [], "workers": names},
                 "hostvars": hostvars}
    lookup_loader.add_directory(str(Path(gpufleet.__file__).parent / "ansible_plugins" / "lookup"))
    lookup = lookup_loader.get("gpufleet_plan")
    (first,) = lookup.run([], variables)
    # as fab would have made it, with --set on top of the inventory
    inputs = {**first["inputs"], "overrides": {**first["inputs"]["overrides"],
                                               "args": {"decode": {"--max-num-seqs": 96}}}}
    (again,) = lookup.run([], variables, inputs=inputs, quarantine=["lab3"])
    assert again["quarantined"] == ["lab3"]
    assert "lab3" not in again["hosts"] and set(first["hosts"]) == set(names)
    kept = {p["name"] for p in again["processes"]}
    assert kept == {p["name"] for p in first["processes"] if p["host"] != "lab3"}
    decode = next(p for p in again["processes"] if p["name"] == "decode")
    assert decode["argv"][decode["argv"].index("--max-num-seqs") + 1] == "96"
    # what the deploy cannot do without stops it with the planner's reason
    with pytest.raises(Exception, match="lab1 runs router, router-1"):
        lookup.run([], variables, inputs=inputs, quarantine=["lab1"])


@pytest.mark.parametrize("value", [-1, 101, "many"])
def test_a_bad_max_fail_percentage_is_refused(value):
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", inv_mod.placeholder({"workers": 3}),
                  {**POOL, "max_fail_percentage": value})
    assert "max_fail_percentage" in str(err.value)


def test_the_plan_says_its_bound_and_its_inputs():
    plan = make_plan("h200-pd-1node", inv_mod.placeholder({"workers": 3}),
                     {**POOL, "max_fail_percentage": 34})
    data = plan.to_json()
    assert data["max_fail_percentage"] == 34
    assert data["inputs"] == {"target": "h200-pd-1node",
                              "overrides": {**POOL, "max_fail_percentage": 34}}


def test_the_tasks_that_act_on_a_deployment_leave_out_what_its_deploy_quarantined(
        tmp_path, monkeypatch, capsys):
    # fab status, logs, health, restart... plan from the controller's record of the last
    # deploy (playbooks/serve.yml writes it): the hosts it quarantined stay out of them,
    # and teardown takes them too
    import json

    from gpufleet import tasks
    from gpufleet.plan import hosts_record_path

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    inv_dir = tmp_path / "prod"
    (inv_dir / "group_vars").mkdir(parents=True)
    (inv_dir / "hosts.yml").write_text(
        "all:\n  children:\n    workers:\n      hosts: {w1: {}, w2: {}, w3: {}}\n")
    (inv_dir / "group_vars" / "all.yml").write_text(
        "gpufleet_target: h200-pd-1node\ngpufleet_workers: {prefill: 1, decode: 4}\n")
    record = Path(hosts_record_path(inv_mod.load(str(inv_dir))))
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"hosts": ["w1", "w2", "w3"], "target": "h200-pd-1node",
                                  "options": [], "runtime": "venv", "quarantined": ["w3"]}))
    serving = tasks._deployed(None, str(inv_dir))
    assert serving.quarantined == ["w3"] and "w3" not in serving.hosts
    assert "without w3, which that deploy quarantined" in capsys.readouterr().err
    assert "w3" in tasks._deployed(None, str(inv_dir), serving=False).hosts
    # a record from before quarantine existed (no key): every host
    record.write_text(json.dumps({"hosts": ["w1", "w2", "w3"], "target": "h200-pd-1node",
                                  "options": [], "runtime": "venv"}))
    assert "w3" in tasks._deployed(None, str(inv_dir)).hosts

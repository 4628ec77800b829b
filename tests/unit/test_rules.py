"""Every validation rule refuses its case with the field and a fix, and is the rule
that catches it: with that rule removed from RULES the same input plans silently."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gpufleet import catalog as cat
from gpufleet import inventory, rules
from gpufleet.catalog import lockfile
from gpufleet.plan import PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]
VLLM_LOCK = "gpufleet/catalog/locks/vllm-x86_64-py312.txt"  # h200-pd-1node's hosts install it

# rule -> (target, overrides, text the message must contain)
CASES = {
    "speculative_matches": (
        "h200-pd-1node",
        {"args": {"decode": {"--speculative-config": {"method": "mtp",
                                                      "num_speculative_tokens": 3}}}},
        "speculative"),
    "layouts_match": (
        # acknowledged (a pin of the recipe): the rule still holds the pair together
        "h200-pd-1node", {"env": {"decode": {"VLLM_KV_CACHE_LAYOUT": "NHD"}},
                          "acknowledge": ["VLLM_KV_CACHE_LAYOUT"]},
        "VLLM_KV_CACHE_LAYOUT"),
    "fp8_kv_on_hopper": (
        "h200-pd-1node", {"args": {"engines": {"--kv-cache-dtype": "fp8"}}}, "Hopper"),
    "weights_fit": (
        "sglang-h200-low-latency", {"args": {"engines": {"--mem-fraction-static": 0.5}}},
        "GiB of weights"),
    "parallel_matches_gpus": (
        "gb200-tray", {"args": {"worker": {"--tensor-parallel-size": 2}}}, "TP 2"),
    "context_parallel_fits": (
        "sglang-gb300-low-latency", {"options": ["cp"]},
        "--attn-cp-size 8 does not divide --tp-size 4"),
    "gpus_disjoint": (
        "h200-pd-1node", {"gpus": {"decode": [3, 4, 5, 6]}}, "already used by prefill"),
    "ports_unique": (
        "h200-pd-1node", {"ports": {"router": {"http": 8001}}}, "port 8001"),
    "metrics_port_free": (
        "h200-pd-1node", {"metrics_allow": ["10.0.0.5"], "metrics_port": 8002},
        "8002 is the decode's port"),
    "no_speculative_on_amd": (
        "sglang-mi355x-low-latency",
        {"args": {"engines": {"--speculative-algorithm": "EAGLE"}}}, "gfx950"),
    "dflash2_constraints": (
        "sglang-h200-balanced", {"options": ["dflash2"]}, "DP attention"),
    "no_zigzag": (
        "sglang-h200-low-latency",
        {"options": ["cp"], "args": {"engines": {"--cp-strategy": "zigzag"}}}, "zigzag"),
    "layer_split_needs_pd_mooncake": (
        "sglang-h200-low-latency", {"options": ["layer-split"]}, "Mooncake"),
    "fp8_kv_option_on_hopper_only": (
        "sglang-b200-low-latency", {"options": ["fp8-kv"]}, "already runs FP8 KV"),
    "flags_accepted": (
        "gb200-tray", {"args": {"worker": {"--no-such-flag": 1}}}, "unknown flag --no-such-flag"),
    "engine_limits": (
        "h200-pd-1node", {"args": {"decode": {"--gpu-memory-utilization": 1.5}}}, "is above 1"),
    # a cell 004 leaves out: the refusal's reason is this rule's message
    "nvfp4_needs_blackwell": ("sglang-h200-low-latency-nvfp4", {}, "Blackwell"),
    "venv_runtime_needs_nvidia": (
        "sglang-mi355x-low-latency", {"runtime": "venv"},
        "no ROCm build of sglang 0.5.23 is on the package index (https://pypi.org/simple); the "
        "venv runtime would install CUDA wheels on an AMD host (AMD Instinct MI355X"),
}


def crafted_lock(request, pins: dict[str, str]) -> None:
    """The locks are read from a copy of the repository's in tmp_path where VLLM_LOCK pins
    `pins` instead (name -> version; a name the lock lacks is added)."""
    tmp = request.getfixturevalue("tmp_path")
    text = (REPO / VLLM_LOCK).read_text()
    for name, version in pins.items():
        pinned = lockfile.read(REPO / VLLM_LOCK).pins.get(name)
        text = (text.replace(f"{name}=={pinned[0]} ", f"{name}=={version} ") if pinned
                else text + f"{name}=={version} \\\n    --hash=sha256:{'0' * 64}\n")
    (tmp / VLLM_LOCK).parent.mkdir(parents=True)
    (tmp / VLLM_LOCK).write_text(text)
    request.getfixturevalue("monkeypatch").setattr(lockfile, "REPO", tmp)


def _loopback_inventory():
    inv = inventory.placeholder({"workers": 1})
    inv.hosts["workers-1"] = inventory.Host("workers-1", "127.0.0.1", {})
    return inv


def _case(name, request):
    """(target, inventory, overrides, text)"""
    if name == "gateway_has_an_address":
        return "h200-pd-1node", _loopback_inventory(), {}, "API gateway would listen on 127"
    if name == "flashinfer_at_floor":
        crafted_lock(request, {"flashinfer-python": "0.6.16"})
        return "h200-pd-1node", None, {}, (
            f"{VLLM_LOCK} installs flashinfer-python 0.6.16, below the floor 0.6.18")
    target, overrides, text = CASES[name]
    return target, None, overrides, text


ALL = [*CASES, "gateway_has_an_address", "flashinfer_at_floor"]


def test_every_rule_has_a_case():
    assert {r.__name__ for r in rules.RULES} == set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_rule_refuses_with_field_and_fix(name, request):
    target, inv, overrides, text = _case(name, request)
    with pytest.raises(PlanError) as err:
        make_plan(target, inv, overrides)
    messages = [str(p) for p in err.value.problems]
    assert any(text in m for m in messages), messages
    assert all("Fix: " in m for m in messages)


@pytest.mark.parametrize("name", ALL)
def test_without_the_rule_the_case_gets_through(name, request, monkeypatch):
    target, inv, overrides, text = _case(name, request)
    monkeypatch.setattr(rules, "RULES", [r for r in rules.RULES if r.__name__ != name])
    try:
        make_plan(target, inv, overrides)
    except PlanError as err:  # other rules may still object, but not with this message
        assert not any(text in str(p) for p in err.problems)


def test_unknown_target_suggests_the_nearest_names():
    with pytest.raises(PlanError, match="did you mean h200-pd-1node"):
        make_plan("h200-pd-1nod")


UNOFFERED = sorted(cat.load().unoffered)


def test_the_matrix_leaves_out_what_004_excludes():
    """NVFP4 off Blackwell and BF16 on one MI300X node; nothing else, nothing listed."""
    c = cat.load()
    want = {f"sglang-{hw}-{s}-nvfp4" for hw in ("h200", "mi300x", "mi325x", "mi355x")
            for s in ("low-latency", "balanced", "high-throughput")}
    want |= {f"sglang-mi300x-{s}-bf16" for s in ("low-latency", "balanced", "high-throughput")}
    assert set(UNOFFERED) == want
    assert not set(UNOFFERED) & set(c.targets)


@pytest.mark.parametrize("name", UNOFFERED)
def test_an_unoffered_cell_is_refused_with_a_rules_reason_and_offered_names(name):
    c = cat.load()
    with pytest.raises(PlanError) as err:
        make_plan(name)
    (problem,) = err.value.problems
    assert problem.field == "target" and f"{name} is not offered: " in problem.message
    reason = "runs only on Blackwell" if name.endswith("-nvfp4") else "GiB of weights"
    assert reason in problem.message  # a rule's message, not a catalog note
    suggested = [w.strip(",") for w in problem.fix.split() if w.startswith("sglang-")]
    assert suggested and all(n in c.targets for n in suggested), problem.fix
    assert suggested[0] == name.rsplit("-", 1)[0]  # FP8 on the same GPUs first


def test_bf16_on_mi300x_gives_the_catalogs_numbers():
    c = cat.load()
    weights = c.models["glm-5.3-bf16"].weight_gib
    hw = c.hardware["mi300x"]
    usable = hw.gpus_per_node * hw.memory_mib / 1024 * 0.8  # the matrix's mem_fraction
    with pytest.raises(PlanError) as err:
        make_plan("sglang-mi300x-balanced-bf16")
    text = str(err.value)
    assert f"needs {weights:.0f} GiB of weights" in text
    assert f"= {usable:.0f} GiB on 1 {hw.product} node" in text
    assert f"({usable * 0.85:.0f} GiB) may hold weights" in text
    assert "sglang-mi300x-balanced (FP8" in text
    assert "sglang-mi325x-balanced-bf16, sglang-mi355x-balanced-bf16 (BF16" in text


def test_nvfp4_on_hopper_suggests_fp8_there_and_nvfp4_on_blackwell():
    with pytest.raises(PlanError) as err:
        make_plan("sglang-h200-balanced-nvfp4")
    text = str(err.value)
    assert "NVFP4, which runs only on Blackwell, not on NVIDIA H200" in text
    assert "use sglang-h200-balanced (FP8 on NVIDIA H200)" in text
    for hw in ("b200", "b300", "gb300"):
        assert f"sglang-{hw}-balanced-nvfp4" in text


def test_an_unknown_name_is_still_unknown():
    with pytest.raises(PlanError, match="unknown target 'sglang-h200-balanced-fp4'.*did you "
                       "mean"):
        make_plan("sglang-h200-balanced-fp4")


def test_inventory_with_the_wrong_groups_is_refused():
    inv = inventory.placeholder({"workers": 2})
    with pytest.raises(PlanError) as err:
        make_plan("h200-disagg", inv)
    text = str(err.value)
    assert "needs exactly 1 host(s) in group 'prefill'" in text
    assert "Fix: put 1 host(s) in [prefill]" in text


def test_inventory_with_too_many_hosts_is_refused():
    with pytest.raises(PlanError, match="the inventory has 2"):
        make_plan("h200-pd-1node", inventory.placeholder({"workers": 2}))


def test_host_declared_as_other_hardware_is_refused():
    inv = inventory.placeholder({"workers": 1})
    inv.hosts["workers-1"] = inventory.Host("workers-1", "10.0.0.1",
                                            {"gpufleet_hardware": "mi355x"})
    with pytest.raises(PlanError, match="declared 'mi355x'.*Fix: pick a mi355x target"):
        make_plan("h200-pd-1node", inv)


def test_unknown_option_and_option_for_another_engine():
    with pytest.raises(PlanError, match="unknown option 'hicash'"):
        make_plan("sglang-h200-low-latency", None, {"options": ["hicash"]})
    with pytest.raises(PlanError, match="applies to sglang targets"):
        make_plan("h200-pd-1node", None, {"options": ["hicache"]})


def test_wrong_override_types_name_the_field():
    with pytest.raises(PlanError, match=r"gpufleet_ports\.router\.http"):
        make_plan("h200-pd-1node", None, {"ports": {"router": {"http": "eighty"}}})
    with pytest.raises(PlanError, match=r"overrides\.colour"):
        make_plan("h200-pd-1node", None, {"colour": "blue"})


def test_disaggregated_targets_warn_about_n():
    assert any("n > 1" in w for w in make_plan("h200-disagg").warnings)
    assert not any("n > 1" in w for w in make_plan("h200-agg").warnings)


def test_loopback_host_plans_without_the_key():
    plan = make_plan("h200-pd-1node", _loopback_inventory(), {"api_key": False})
    assert not plan.by_role("gateway") and plan.api == {"key_required": False}
    (router,) = plan.by_role("router")
    assert router.args["--host"] == "0.0.0.0"


def test_replicas_put_an_independent_copy_on_every_host():
    inv = inventory.placeholder({"workers": 3})
    plan = make_plan("h200-pd-1node", inv, {"replicas": True})
    assert len(plan.endpoints) == 3 and plan.endpoint == plan.endpoints[0]
    for host in inv.hosts:
        procs = {p.role: p for p in plan.processes if p.host == host}
        assert set(procs) == {"prefill", "decode", "router", "gateway"}
        # each router talks to its own host's pools, on loopback
        assert procs["router"].args["--prefill"] == "http://127.0.0.1:8001"
        assert procs["gateway"].bind == inv.hosts[host].address
    assert set(plan.hosts) == set(inv.hosts)


def test_replicas_of_a_multi_node_target_are_refused():
    inv = inventory.placeholder({"prefill": 2, "decode": 2})
    with pytest.raises(PlanError, match="replicas copy a single-node target.*Fix: drop"):
        make_plan("h200-disagg", inv, {"replicas": True})


def test_flashinfer_companion_at_another_version_is_refused(request):
    crafted_lock(request, {"flashinfer-cubin": "0.7.0"})
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node")
    (problem,) = err.value.problems
    assert problem.field == "hosts.workers-1.engine.lock"
    assert ("installs flashinfer-cubin 0.7.0 next to flashinfer-python 0.7.2.post1"
            in problem.message)
    assert "require flashinfer-cubin==0.7.2.post1" in problem.fix


@pytest.mark.parametrize("engine", ["vllm", "dynamo"])
def test_the_real_locks_install_flashinfer_at_or_above_the_floor(engine):
    """Every lock of an engine with a floor passes the rule (not only those a plan picks)."""
    c = cat.load()
    floor = c.engines[engine].flashinfer_floor
    assert floor == "0.6.18"
    for arch, python in c.lock_combos(engine):
        path = c.lock_path(engine, arch, python)
        plan = SimpleNamespace(engine=c.engines[engine], target=SimpleNamespace(engine=engine),
                               model=None,
                               hosts={"h": SimpleNamespace(engine=SimpleNamespace(lock=path))})
        assert rules.flashinfer_at_floor(plan, c) == [], path


def test_the_venv_runtime_on_amd_is_refused_before_any_host_even_as_a_plan():
    """No lock installs an engine on AMD: the plan (which every fab task and playbook
    computes first) refuses the venv runtime there, so no host is touched."""
    with pytest.raises(PlanError) as err:
        make_plan("sglang-mi300x-balanced", overrides={"runtime": "venv"})
    (problem,) = err.value.problems
    assert problem.field == "engine.runtime"
    assert "no ROCm build of sglang 0.5.23" in problem.message
    assert "CUDA wheels on an AMD host (AMD Instinct MI300X: workers-1)" in problem.message
    assert "gpufleet_runtime: image" in problem.fix
    assert make_plan("sglang-mi300x-balanced").hosts["workers-1"].engine.runtime == "image"



"""gpufleet_health_config: the health checker's config for one host of real plans
(roles/health/README.md has the schema). Until it replaced it, the filter was checked
byte for byte against the role's Jinja template for these plans and settings."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from gpufleet import inventory
from gpufleet.ansible_plugins.filter.health_config import health_config
from gpufleet.ansible_plugins.lookup.gpufleet_role_inputs import options as spec_options
from gpufleet.model import host_slices
from gpufleet.plan import make_plan

ROLE = Path(__file__).resolve().parents[2] / "roles" / "health"
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
# what gpufleet_role_options hands the filter: every health_* setting the argument spec
# declares, without the prefix, at its default
SETTINGS = {name.removeprefix("health_"): DEFAULTS[name] for name in spec_options(ROLE)
            if name.startswith("health_")}
FM = "nvidia-fabricmanager.service"


def config(plan, host, fabric_external=False, **changed):
    return health_config(host_slices(plan.to_json() if hasattr(plan, "to_json") else plan)[host],
                         dict(SETTINGS, **changed), fabric_external)


def engine(name, port, grace=3600, depends_on=(FM,), drain=True):
    return {"unit": f"gpufleet-{name}.service", "name": name, "role": name,
            "health_url": f"http://127.0.0.1:{port}/health", "generate_url": None,
            "served_name": None, "ca_file": None, "api_key_file": None, "health_timeout_s": 5,
            "generate_timeout_s": 30, "startup_grace_s": grace, "restart": True,
            "depends_on": list(depends_on), "drain": drain}


ONE_NODE = {
    "version": 1,
    "host": "workers-1",
    "textfile": "/var/lib/prometheus/node-exporter/gpufleet.prom",
    "state_file": "/var/lib/gpufleet/health-state.json",
    "restart": {"enabled": True, "after_failures": 3, "cooldown_s": 3600},
    "units": [
        engine("prefill", 8001),
        engine("decode", 8002),
        dict(engine("router", 8000, 300,
                    ["gpufleet-prefill.service", "gpufleet-decode.service"], drain=False),
             generate_url="http://127.0.0.1:8000/v1/completions",
             served_name="zai-org/GLM-5.3-Flash"),
        dict(engine("gateway", 8000, 300, ["gpufleet-router.service"], drain=False),
             # the gateway over TLS, verified with the deployment's CA on the host
             health_url="https://workers-1:8000/health", ca_file="/etc/gpufleet/gateway/ca.crt"),
        {"unit": FM, "name": "nvidia-fabricmanager", "role": "host", "restart": False,
         "depends_on": [], "drain": False,
         "fix": "start it (systemctl start nvidia-fabricmanager.service; its journal says why "
                "it stopped); engines that restart before it runs again fail to start, so the "
                "checker does not restart them meanwhile"},
    ],
    "cache": {"path": "/var/cache/gpufleet/hf", "min_free_gib": 10.0},
    "gpu": {"vendor": "nvidia", "count": 8, "timeout_s": 30,
            "xid_fatal": [48, 61, 62, 64, 74, 79, 95, 119, 120, 140, 154],
            "ecc_aggregate_max": 10, "temperature_max_c": 100.0,
            "nvlink_error_delta_max": {"recovery": 0, "replay": 100, "crc": 100, "default": 100},
            "fabric": False},
    "ib": None,
    "gateway": {"log_tag": "gpufleet_gateway"},
    "watch": {"interval_s": 2.0},
    "drain": {"enabled": True, "after_runs": 2, "return_after_runs": 3, "cooldown_s": 600.0},
}


def depends(cfg) -> dict:
    return {u["unit"]: u["depends_on"] for u in cfg["units"]}


def test_one_node():
    cfg = config(make_plan("h200-pd-1node"), "workers-1")
    assert cfg == ONE_NODE
    # written as the role writes it: keys in this order, not sorted
    assert json.dumps(cfg).startswith('{"version": 1, "host": "workers-1", "textfile"')


def test_fabric_managed_outside_the_host_checks_the_gpus_fabric_state_instead():
    cfg = config(make_plan("h200-pd-1node"), "workers-1", fabric_external=True)
    assert FM not in depends(cfg) and cfg["gpu"]["fabric"] is True
    assert depends(cfg)["gpufleet-prefill.service"] == []


def test_two_nodes_each_host_checks_its_own_units():
    plan = make_plan("h200-disagg")
    assert depends(config(plan, "decode-1")) == {"gpufleet-decode.service": [FM], FM: []}
    assert depends(config(plan, "prefill-1")) == {
        "gpufleet-etcd.service": [],
        "gpufleet-prefill.service": ["gpufleet-etcd.service", FM],
        "gpufleet-router.service": ["gpufleet-prefill.service", "gpufleet-etcd.service"],
        "gpufleet-gateway.service": ["gpufleet-router.service"],
        FM: []}
    decode = config(plan, "decode-1")["units"][0]
    assert decode["health_url"] == "http://decode-1:9090/health"


def test_hosts_that_move_kv_over_rdma_check_their_hca_ports():
    plan = make_plan("h200-disagg")
    for host in ("prefill-1", "decode-1"):
        assert config(plan, host)["ib"] == {
            "sysfs": "/sys/class/infiniband", "devices": [], "min_rate_gbps": None,
            "error_delta_max": {"link_downed": 0, "link_error_recovery": 0, "default": 100}}
    assert config(plan, "prefill-1", ib_min_rate_gbps="400")["ib"]["min_rate_gbps"] == 400.0
    assert config(make_plan("h200-pd-1node"), "workers-1")["ib"] is None  # NVLink only


def test_hosts_that_run_the_gateway_count_its_responses_from_its_log():
    """`gateway` on the hosts with a gateway process only; the tag is the one the gateway's
    nginx logs under (roles/serve/templates/gateway-nginx.conf.j2)."""
    plan = make_plan("h200-disagg")
    assert config(plan, "prefill-1")["gateway"] == {"log_tag": "gpufleet_gateway"}
    assert config(plan, "decode-1")["gateway"] is None
    nginx = (ROLE.parent / "serve" / "templates" / "gateway-nginx.conf.j2").read_text()
    assert "tag=gpufleet_gateway," in nginx
    for name in ("sglang-h200-balanced", "gb200-tray"):
        assert config(make_plan(name), "workers-1")["gateway"] == {"log_tag": "gpufleet_gateway"}


def test_replicas_each_host_gets_the_one_node_config_with_its_name():
    plan = make_plan("h200-pd-1node", inventory.placeholder({"workers": 3}), {"replicas": True})
    for host in ("workers-1", "workers-2", "workers-3"):
        want = copy.deepcopy(ONE_NODE)
        want["host"] = host
        want["units"][3]["health_url"] = f"https://{host}:8000/health"
        assert config(plan, host) == want


def test_an_sglang_worker_generates_itself_and_the_gateway_depends_on_it():
    worker, gateway, _ = config(make_plan("sglang-h200-balanced"), "workers-1")["units"]
    assert (worker["generate_url"], worker["served_name"]) == (
        "http://127.0.0.1:30000/health_generate", "zai-org/GLM-5.3")
    assert gateway["depends_on"] == ["gpufleet-worker.service"]


def test_imex_is_a_host_service_of_a_grace_blackwell_tray():
    cfg = config(make_plan("gb200-tray"), "workers-1")
    assert depends(cfg) == {"gpufleet-worker.service": ["nvidia-imex.service"],
                            "gpufleet-gateway.service": ["gpufleet-worker.service"],
                            "nvidia-imex.service": []}
    assert cfg["units"][0]["generate_url"] == "http://127.0.0.1:8000/v1/completions"
    assert cfg["gpu"]["count"] == 4


def test_settings_apply_and_strings_from_extra_vars_are_read_as_ansible_reads_them():
    cfg = config(make_plan("h200-pd-1node"), "workers-1", api_key_file="/etc/gpufleet/api-key",
                 startup_grace_s=77, restart_enabled="false", restart_roles=["router"],
                 cache_min_free_gib=3, http_timeout_s="7")
    units = {u["unit"]: u for u in cfg["units"]}
    router, prefill = units["gpufleet-router.service"], units["gpufleet-prefill.service"]
    assert router["api_key_file"] == "/etc/gpufleet/api-key" and prefill["api_key_file"] is None
    assert {u["startup_grace_s"] for u in cfg["units"] if "fix" not in u} == {77}
    assert not any(u["restart"] for u in cfg["units"]) and cfg["restart"]["enabled"] is False
    assert router["health_timeout_s"] == 7
    assert cfg["cache"] == {"path": "/var/cache/gpufleet/hf", "min_free_gib": 3.0}


def test_a_host_without_engines_or_gpus_checks_no_cache_and_no_gpus():
    plan = make_plan("h200-disagg").to_json()
    plan["processes"] = [p for p in plan["processes"]
                         if not (p["host"] == "prefill-1" and p["role"] == "prefill")]
    for p in plan["processes"]:  # as the plan gives such a host: nothing depends on it
        deps = p["health"]["depends_on"]
        if "gpufleet-prefill.service" in deps:
            deps.remove("gpufleet-prefill.service")
    plan["hosts"]["prefill-1"]["gpu"]["used"] = []
    cfg = config(plan, "prefill-1")
    assert cfg["cache"] is None
    assert (cfg["gpu"]["vendor"], cfg["gpu"]["count"]) == (None, None)
    assert depends(cfg)["gpufleet-gateway.service"] == ["gpufleet-router.service"]
    assert depends(cfg)["gpufleet-router.service"] == ["gpufleet-etcd.service"]


def test_wrong_calls_name_the_fix():
    plan = make_plan("h200-pd-1node")
    options = dict(SETTINGS)
    del options["textfile"]
    with pytest.raises(ValueError, match=r"no health_textfile among the settings; pass "
                                         r"lookup\('gpufleet.fleet.gpufleet_role_options'"):
        health_config(host_slices(plan.to_json())["workers-1"], options)
    with pytest.raises(ValueError, match="health_restart_enabled must be true or false"):
        config(plan, "workers-1", restart_enabled="maybe")
    with pytest.raises(ValueError, match="slice of the plan .* Fix: pass gpufleet_host"):
        health_config(plan.to_json(), SETTINGS)


def test_the_role_hands_the_filter_its_declared_settings():
    """One list of the role's settings, its argument spec: the task passes them all through
    the lookup, and each has its default."""
    tasks = yaml.safe_load((ROLE / "tasks" / "install.yml").read_text())
    (task,) = [t for t in tasks if "gpufleet_health_config" in str(t)]
    content = " ".join(task["ansible.builtin.copy"]["content"].split())
    assert "gpufleet.fleet.gpufleet_health_config(lookup('gpufleet.fleet.gpufleet_role_options', " \
        "prefix='health_')" in content
    declared = {n for n in spec_options(ROLE) if n.startswith("health_")}
    assert declared == {n for n in DEFAULTS if n.startswith("health_")}

"""The gateway's nginx configuration (roles/serve/templates/gateway-nginx.conf.j2) as
Ansible renders it for real plans: which routers it sends to, in which order, how often."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from test_plan_workers import hosts

from gpufleet.model import host_slices
from gpufleet.plan import make_plan

ROLE = Path(__file__).resolve().parents[2] / "roles" / "serve"
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())


def gateway_conf(plan) -> str:
    host = next(p.host for p in plan.processes if p.role == "gateway")
    slice_ = host_slices(plan.to_json())[host]
    listen = next(p for p in slice_["processes"] if p["role"] == "gateway")["ports"]["http"]
    variables = dict(DEFAULTS, gpufleet_host=slice_, __serve_api=slice_["api"],
                     __serve_gateway_listen=f"{slice_['address']}:{listen}",
                     ansible_managed="managed")
    source = (ROLE / "templates" / "gateway-nginx.conf.j2").read_text()
    # the role's own template file: trusted, as Ansible trusts a role's templates
    return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(source))


def upstream(conf: str) -> list[str]:
    block = re.search(r"upstream gpufleet_api \{(.*?)\}", conf, re.S).group(1)
    return re.findall(r"^\s*server (.+);$", block, re.M)


def test_a_vllm_pool_sends_to_the_first_router_and_to_the_second_only_as_its_backup():
    # a rolling restart restarts one router at a time and never reloads nginx: the first
    # router's tries come first, then the backup's, so a restarting router costs nothing
    conf = gateway_conf(make_plan("h200-pd-1node", hosts(workers=2),
                                  {"workers": {"prefill": 2, "decode": 2}}))
    assert upstream(conf) == ["127.0.0.1:8000 max_fails=0"] * 5 + \
        ["127.0.0.1:8100 max_fails=0 backup"] * 5
    assert "proxy_next_upstream error http_500 http_502 http_503 non_idempotent;" in conf
    assert re.search(r"proxy_next_upstream_tries (\d+);", conf).group(1) == "10"


def test_one_router_is_tried_once_per_try_of_a_pool_and_once_without_one():
    # an SGLang pool has two routers as a vLLM pool has (a count change rolls them)
    conf = gateway_conf(make_plan("sglang-h200-pd", hosts(prefill=1, decode=2),
                                  {"workers": {"decode": 2}}))
    assert upstream(conf) == ["127.0.0.1:8000 max_fails=0"] * 5 + \
        ["127.0.0.1:8100 max_fails=0 backup"] * 5
    # a Dynamo pool has one frontend: five tries of it; no pool: one try
    conf = gateway_conf(make_plan("h200-disagg", hosts(prefill=1, decode=2),
                                  {"workers": {"decode": 2}}))
    assert len(set(upstream(conf))) == 1 and len(upstream(conf)) == 5
    assert re.search(r"proxy_next_upstream_tries (\d+);", conf).group(1) == "5"
    conf = gateway_conf(make_plan("h200-pd-1node", hosts(workers=1), {}))
    assert upstream(conf) == ["127.0.0.1:8000 max_fails=0"] and "proxy_next_upstream" not in conf

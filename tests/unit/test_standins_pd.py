"""Prefill/decode through the REAL routers (vllm-router 0.1.17, sglang-router 0.3.2).

The engine command lines are the vLLM recipe's (seed 000) with the ports changed; a layout or MTP
difference between prefill and decode must fail the routed request, naming the field.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from string import Template

import openai
import pytest
import test_standins as base
from test_standins import FLASH, READY, Server, client, free_port, http

ROUTER_BIN = Path(sys.executable).parent  # pip install vllm-router==0.1.17 sglang-router==0.3.2

NIXL_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS", "VLLM_KV_CACHE_LAYOUT": "HND",
            "UCX_NET_DEVICES": "all"}
MTP5 = '{"method":"mtp","num_speculative_tokens":5}'
# Seed 000, "Prefill/Decode disaggregation (single node, TP4 + TP4)", ports changed.
# (--no-disable-hybrid-kv-cache-manager is left out: see test_seed_flags_parse.)
PREFILL = (f"vllm serve {FLASH} --port $port --tensor-parallel-size 4 "
           """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}' """
           f"--speculative-config '{MTP5}' "
           """--compilation-config '{"cudagraph_mm_encoder": true}' --enforce-eager """
           f"--served-model-name {FLASH} --host 127.0.0.1")
DECODE = (f"vllm serve {FLASH} --port $port --tensor-parallel-size 4 "
          """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}' """
          "--speculative-config '$spec' --max-num-seqs 512 "
          f"--served-model-name {FLASH} --host 127.0.0.1")
VLLM_ROUTER = ("vllm-router --policy round_robin --vllm-pd-disaggregation "
               "--prefill http://127.0.0.1:$p --decode http://127.0.0.1:$d "
               "--host 127.0.0.1 --port $port --intra-node-data-parallel-size 1 "
               "--prometheus-port $prom")


class Procs:
    def __init__(self, tmp: Path, venv: Path):
        self.tmp, self.venv, self.servers = tmp, venv, []

    def start(self, cmd: str, env: dict, name: str, path="/health", **fmt) -> Server:
        port = free_port()
        cmd = Template(cmd).substitute(port=port, **fmt)
        argv = shlex.split(cmd)
        if argv[0] in ("vllm-router", "python-router"):
            argv[0] = str(ROUTER_BIN / argv[0]) if argv[0] == "vllm-router" else sys.executable
        server = Server(shlex.join(argv), env, self.venv, self.tmp / f"{name}.log", port)
        self.servers.append(server)
        return server

    def stop(self):
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture(scope="session")
def lab_venv(tmp_path_factory):
    return base.make_venv(tmp_path_factory.mktemp("standins-pd"))


@pytest.fixture
def env(tmp_path, lab_venv):
    return base.lab_env(tmp_path, lab_venv)


@pytest.fixture
def procs(tmp_path, lab_venv):
    p = Procs(tmp_path, lab_venv)
    yield p
    p.stop()


def nixl_env(base: dict, gpus: str, side_port: int, **extra) -> dict:
    return {**base, **NIXL_ENV, "CUDA_VISIBLE_DEVICES": gpus,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), **extra}


@pytest.mark.parametrize("decode_env, spec, field", [
    ({}, MTP5, None),
    ({"VLLM_KV_CACHE_LAYOUT": "NHD"}, MTP5, "VLLM_KV_CACHE_LAYOUT"),
    ({}, '{"method":"mtp","num_speculative_tokens":3}', "speculative_config"),
])
def test_vllm_pd_through_vllm_router(decode_env, spec, field, env, procs):
    prefill = procs.start(PREFILL, nixl_env(env, "0,1,2,3", free_port()), "prefill")
    decode = procs.start(DECODE, nixl_env(env, "4,5,6,7", free_port(), **decode_env),
                         "decode", spec=spec)
    prefill.wait()
    decode.wait()
    router_env = {k: v for k, v in env.items() if not k.startswith("GPUFLEET")}
    router = procs.start(VLLM_ROUTER, router_env, "router", p=prefill.port, d=decode.port,
                         prom=free_port()).wait()
    c = client(router)
    low = {"chat_template_kwargs": {"reasoning_effort": "low"}}
    if field is None:
        reply = c.chat.completions.create(model=FLASH, messages=READY, max_tokens=200,
                                          extra_body=low)
        assert reply.choices[0].message.content is not None
        assert "READY" in reply.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=FLASH, messages=READY, stream=True, extra_body=low) if ch.choices)
        assert "READY" in streamed
        assert "NIXL side channel listening" in prefill.log.read_text()
        return
    with pytest.raises(openai.APIStatusError) as err:
        c.chat.completions.create(model=FLASH, messages=READY, max_tokens=50, extra_body=low)
    assert err.value.status_code == 500
    assert "NIXL compatibility hash mismatch" in str(err.value)
    assert field in str(err.value)
    assert field in decode.log.read_text()


SGL_PREFILL = (f"python -m sglang.launch_server --model-path {FLASH} --tp-size 4 "
               "--host 127.0.0.1 --port $port --reasoning-parser auto "
               "--tool-call-parser auto --disaggregation-mode prefill "
               "--disaggregation-bootstrap-port $boot $extra")
SGL_DECODE = (f"python -m sglang.launch_server --model-path {FLASH} --tp-size 4 "
              "--host 127.0.0.1 --port $port --reasoning-parser auto --tool-call-parser auto "
              "--disaggregation-mode decode $extra")
SGL_ROUTER = ("python-router -m sglang_router.launch_router --pd-disaggregation "
              "--prefill http://127.0.0.1:$p $boot --decode http://127.0.0.1:$d "
              "--host 127.0.0.1 --port $port --prometheus-port $prom")
EAGLE = ("--speculative-algorithm EAGLE --speculative-num-steps $n --speculative-eagle-topk 1 "
         "--speculative-num-draft-tokens 6")


@pytest.mark.parametrize("decode_extra, field", [
    (Template(EAGLE).substitute(n=5), None),
    (Template(EAGLE).substitute(n=3), "speculative"),
])
def test_sglang_pd_through_sglang_router(decode_extra, field, env, procs):
    env = {**env, "GPUFLEET_LAB_KV_TIMEOUT": "10"}
    boot = free_port()
    prefill = procs.start(SGL_PREFILL, {**env, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "prefill",
                          boot=boot, extra=Template(EAGLE).substitute(n=5))
    decode = procs.start(SGL_DECODE, {**env, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "decode",
                         extra=decode_extra)
    prefill.wait()
    decode.wait()
    assert "falling back to TCP" in prefill.log.read_text()  # no IB HCA in this lab
    router = procs.start(SGL_ROUTER, env, "router", p=prefill.port, d=decode.port, boot=boot,
                         prom=free_port()).wait(path="/health", timeout=30)
    c = client(router)
    low = {"chat_template_kwargs": {"reasoning_effort": "low"}}
    if field is None:
        reply = c.chat.completions.create(model=FLASH, messages=READY, extra_body=low)
        assert reply.choices[0].message.content == "READY"
        status, body = http(router.url + "/v1/chat/completions", {
            "model": FLASH, "messages": READY, "stream": True, **low})
        assert status == 200 and "READY" in body and "[DONE]" in body
        return
    with pytest.raises(openai.APIStatusError) as err:
        c.chat.completions.create(model=FLASH, messages=READY, extra_body=low)
    assert err.value.status_code == 500
    assert field in str(err.value) and "mismatch" in str(err.value)
    assert field in decode.log.read_text()


def test_direct_request_to_sglang_prefill_is_refused(env, procs):
    prefill = procs.start(SGL_PREFILL, {**env, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "prefill",
                          boot=free_port(), extra="").wait()
    status, body = http(prefill.url + "/v1/chat/completions", {"messages": READY})
    assert status == 400 and "bootstrap_room" in json.loads(body)["message"]


def test_routers_are_the_pinned_ones():
    assert shutil.which("vllm-router", path=str(ROUTER_BIN))
    from importlib.metadata import version

    assert version("vllm-router") == "0.1.17" and version("sglang-router") == "0.3.2"

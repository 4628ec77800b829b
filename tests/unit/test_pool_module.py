"""gpufleet_pool (gpufleet/module_utils/pool.py) against the REAL routers (vllm-router
0.1.17, sglang-router 0.3.2) in front of two stand-in engines each: the moves are the
planner's own (plan._pool_move and the router's PoolDrop), pointed at the ports this
test's processes listen on. The module's code runs on the routers' host, so one round
runs under every host Python too."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import test_standins as base
from test_standins import FLASH, free_port, http
from test_standins_pd import Procs

from gpufleet import catalog, plan
from gpufleet.model import Process
from gpufleet.module_utils import pool

REPO = Path(__file__).resolve().parents[2]
HOST_PYTHONS = Path(os.environ.get("HOST_PYTHONS_DIR", "/root/.pyenv/versions"))

ENGINES = {
    "vllm": f"vllm serve {FLASH} --port $port --host 127.0.0.1 --served-model-name {FLASH} "
            "--tensor-parallel-size 4",
    "sglang": f"python -m sglang.launch_server --model-path {FLASH} --port $port "
              "--host 127.0.0.1 --tp-size 4",
}
ROUTERS = {"vllm": "vllm-router", "sglang": "python-router -m sglang_router.launch_router"}
ARGS = {"wait_s": 20, "unlist_s": 15, "interval": 0.2}


@pytest.fixture(scope="module")
def lab_venv(tmp_path_factory):
    return base.make_venv(tmp_path_factory.mktemp("standins-pool"))


@pytest.fixture
def procs(tmp_path, lab_venv):
    p = Procs(tmp_path, lab_venv)
    yield p
    p.stop()


def proc(name: str, role: str, port: int) -> Process:
    return Process(name=name, role=role, host="h", address="127.0.0.1", argv=[], env={},
                   unit=f"gpufleet-{name}.service", ports={"http": port}, gpus=[], order=1)


def start_pool(engine: str, procs: Procs, tmp_path: Path, workers=("worker", "worker-1")):
    """Two stand-in workers behind the engine's real router, with the pool's router flags;
    (router process, worker processes), as the plan has them."""
    env = base.lab_env(tmp_path, procs.venv)
    servers = [procs.start(ENGINES[engine], {**env, "CUDA_VISIBLE_DEVICES": gpus}, name).wait()
               for name, gpus in zip(workers, ("0,1,2,3", "4,5,6,7"), strict=True)]
    out = start_router(engine, procs, tmp_path, [s.url for s in servers])
    # sglang-router adds the workers of its flags in the background after it answers
    pool.poll(lambda: all(listed(out).get(s.url, {}).get("is_healthy") for s in servers), 30, 0.2)
    return out, [proc(name, "worker", s.port) for name, s in zip(workers, servers, strict=True)]


def start_router(engine: str, procs: Procs, tmp_path: Path, urls: list[str],
                 name: str = "router", **flags) -> Process:
    """The engine's real router with the pool's router flags (and flags) before urls."""
    env = base.lab_env(tmp_path, procs.venv)
    flags = {**catalog.load().engines[engine].pool_args["router"], **flags}
    cmd = (f"{ROUTERS[engine]} --worker-urls {' '.join(urls)} --policy round_robin "
           "--host 127.0.0.1 --port $port --prometheus-port $prom "
           + " ".join(f"{k} {v}" for k, v in flags.items() if k != "--prometheus-port"))
    router = procs.start(cmd, {k: v for k, v in env.items() if not k.startswith("GPUFLEET")},
                         name, prom=free_port()).wait(timeout=30)
    return proc(name, "router", router.port)


def move_of(worker: Process, router: Process, engine: str) -> dict:
    return pool_json(plan._pool_move(worker, [router], catalog.load().engines[engine]))


def pool_json(obj) -> dict:
    """The JSON the plan gives the module (None fields left out)."""
    return json.loads(json.dumps(asdict(obj), default=str),
                      object_hook=lambda d: {k: v for k, v in d.items() if v is not None})


def listed(router: Process) -> dict:
    status, body = http(f"http://127.0.0.1:{router.ports['http']}/workers")
    assert status == 200
    return {w["url"]: w for w in json.loads(body)["workers"]}


def worker_url(w: Process) -> str:
    return f"http://127.0.0.1:{w.ports['http']}"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_worker_leaves_only_while_another_serves_and_comes_back(engine, procs, tmp_path):
    router, (first, second) = start_pool(engine, procs, tmp_path)
    move = move_of(second, router, engine)
    assert move["url"] == worker_url(second) and move["type"] == "regular"
    assert set(listed(router)) == {worker_url(first), worker_url(second)}

    # check mode reads, names the call, sends nothing
    calls = pool.out(move, ARGS, check_mode=True)
    assert len(calls) == 1 and worker_url(second) in listed(router)

    calls = pool.out(move, ARGS, check_mode=False)
    assert calls[0].split()[0] == move["leave"][0]["method"]
    assert set(listed(router)) == {worker_url(first)}
    # out already: nothing more to send
    assert pool.out(move, ARGS, check_mode=False) == []

    # the last healthy worker of its kind is never taken out, and nothing changes
    with pytest.raises(pool.PoolError, match="no healthy regular worker besides"):
        pool.out(move_of(first, router, engine), {**ARGS, "wait_s": 1}, check_mode=False)
    assert set(listed(router)) == {worker_url(first)}

    if engine == "vllm":  # vllm-router takes a worker back only when restarted
        assert "rejoin" not in move and pool.back(move, {**ARGS, "wait_s": 0}, False) == []
        return
    calls = pool.back(move, ARGS, check_mode=False)
    assert calls == [f"POST {move['rejoin'][0]['url']}"]
    assert listed(router)[worker_url(second)]["is_healthy"]
    assert pool.back(move, ARGS, check_mode=False) == []  # in already


def test_a_router_that_no_longer_lists_the_worker_back_in_time_fails_named(procs, tmp_path):
    router, (_, second) = start_pool("sglang", procs, tmp_path)
    move = move_of(second, router, "sglang")
    pool.out(move, ARGS, check_mode=False)
    procs.servers[1].stop()  # the worker does not come back
    with pytest.raises(pool.PoolError, match=r"does not list .* healthy 2 s after"):
        pool.back(move, {**ARGS, "wait_s": 2}, check_mode=False)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_router_lets_go_of_exactly_the_workers_the_plan_drops(engine, procs, tmp_path):
    router, (first, second) = start_pool(engine, procs, tmp_path)
    eng = catalog.load().engines[engine]
    router.readiness.drop = plan.PoolDrop(
        workers_url=f"http://127.0.0.1:{router.ports['http']}/workers",
        keep=[worker_url(first)],
        leave=plan.RouterCall(host="h", method=eng.pool_leave.method,
                              url=plan._router_url(router, eng.pool_leave.path)))
    drop = pool_json(router.readiness.drop)
    assert pool.dropped(drop, check_mode=True) and worker_url(second) in listed(router)
    assert len(pool.dropped(drop, check_mode=False)) == 1
    for _ in range(50):  # sglang-router removes in the background (202)
        if set(listed(router)) == {worker_url(first)}:
            break
        pool.time.sleep(0.1)
    assert set(listed(router)) == {worker_url(first)}
    assert pool.dropped(drop, check_mode=False) == []
    # a router none of whose workers the plan keeps names them otherwise: left alone
    assert pool.dropped({**drop, "keep": ["http://10.0.0.9:1"]}, check_mode=False) == []
    # one that does not answer: nothing to do
    assert pool.dropped({**drop, "workers_url": f"http://127.0.0.1:{free_port()}/workers"},
                        check_mode=False) == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_router_just_started_is_waited_for_until_it_routes_only_to_workers_that_serve(
        engine, procs, tmp_path):
    """A router restarted while one of its workers is down (a failed canary's) first routes
    to it too: settled returns only once it lists no worker healthy that does not answer."""
    router, (first, second) = start_pool(engine, procs, tmp_path)
    pool_router = {"unit": "gpufleet-router.service",
                   "workers_url": f"http://127.0.0.1:{router.ports['http']}/workers"}
    args = {**ARGS, "health_path": "/health"}
    assert pool.settled(pool_router, args, check_mode=False) == []  # every worker serves
    procs.servers[1].stop()
    again = start_router(engine, procs, tmp_path, [worker_url(first), worker_url(second)],
                         "router-1")
    pool_router["workers_url"] = f"http://127.0.0.1:{again.ports['http']}/workers"
    # sglang-router adds the workers of its flags in the background: the wait ends only
    # once it lists one healthy
    pool.settled(pool_router, args, check_mode=False)
    now = listed(again)
    assert now[worker_url(first)]["is_healthy"]
    assert not now.get(worker_url(second), {}).get("is_healthy")
    if engine == "sglang":
        return  # sglang-router takes a worker of its flags only once it answers
    # vllm-router lists it healthy at first; one whose health check takes a minute (the
    # default) is named once the wait is up
    late = start_router(engine, procs, tmp_path, [worker_url(first), worker_url(second)],
                        "router-2", **{"--health-check-interval-secs": 60})
    late_router = {"unit": "gpufleet-router-2.service",
                   "workers_url": f"http://127.0.0.1:{late.ports['http']}/workers"}
    with pytest.raises(pool.PoolError, match=rf"gpufleet-router-2.service still lists "
                       rf"{worker_url(second)} healthy 2 s after it started"):
        pool.settled(late_router, {**args, "wait_s": 2}, check_mode=False)
    gone = {**late_router, "workers_url": f"http://127.0.0.1:{free_port()}/workers"}
    with pytest.raises(pool.PoolError, match="does not answer"):
        pool.settled(gone, {**args, "wait_s": 1}, check_mode=False)
    # a router whose every worker is down routes nowhere: not settled either
    procs.servers[0].stop()
    pool.poll(lambda: not listed(again)[worker_url(first)]["is_healthy"], 20, 0.2)
    with pytest.raises(pool.PoolError, match="router-1.service lists no healthy worker 1 s"):
        pool.settled({**pool_router, "unit": "gpufleet-router-1.service"}, {**args, "wait_s": 1},
                     check_mode=False)


ROUND = """
import json, sys
sys.path.insert(0, {utils!r})
import pool
move, args = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps([pool.out(move, args, False), pool.back(move, args, False)]))
"""


@pytest.mark.parametrize("version", ["3.8", "3.9", "3.10", "3.12", "3.13"])
def test_a_round_out_and_back_on_every_host_python(version, procs, tmp_path):
    """sglang-router's round (an id from GET /workers, a 202 and its wait, a body)."""
    python = next(iter(sorted(HOST_PYTHONS.glob(f"{version}*/bin/python"))), None)
    assert python, f"no Python {version} under {HOST_PYTHONS} (HOST_PYTHONS_DIR)"
    router, (_, second) = start_pool("sglang", procs, tmp_path)
    move = move_of(second, router, "sglang")
    run = subprocess.run(
        [str(python), "-c", ROUND.format(utils=str(REPO / "gpufleet/module_utils")),
         json.dumps(move), json.dumps(ARGS)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    left, back = json.loads(run.stdout)
    assert len(left) == 1 and left[0].startswith("DELETE ") and "{id}" not in left[0]
    assert back == [f"POST {move['rejoin'][0]['url']}"]
    assert listed(router)[worker_url(second)]["is_healthy"]

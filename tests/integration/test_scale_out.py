"""gpufleet_workers on the lab: two prefill and two decode workers over lab1 and lab2 behind
two real vllm-routers and one endpoint; every worker takes requests, a killed one leaves the
pool within seconds, rolling restarts of workers and routers lose no request, a lower count
stops exactly the workers it drops."""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from labutil import (
    changed_tasks,
    env_client,
    fab,
    lab_inventory,
    main_pids,
    recap,
    requests_finished,
    ssh,
)

from gpufleet_lab import net

TARGET = "h200-pd-1node"
ADDRESS = {f"lab{i}": net.host_address(i) for i in (1, 2)}
# where each worker runs and its HTTP port (the plan's placement: host by host)
# the gateway's configuration and its nginx worker processes: a reload changes the latter
GATEWAY_STATE = ("cat /etc/gpufleet/gateway/nginx.conf; "
                 "pgrep -P $(systemctl show -p MainPID --value gpufleet-gateway) | sort")
WORKERS = {"prefill": ("lab1", 8001), "decode": ("lab1", 8002),
           "prefill-1": ("lab2", 8001), "decode-1": ("lab2", 8002)}


def inventory(tmp_path, workers: dict) -> str:
    return lab_inventory(tmp_path, {"gpufleet_target": TARGET, "gpufleet_workers": workers},
                         groups={"workers": ["lab1", "lab2"]})


def served(worker: str) -> float:
    """Requests the worker finished (vllm:request_success_total, every reason)."""
    host, port = WORKERS[worker]
    return requests_finished(ADDRESS[host], port)


@pytest.fixture(scope="module")
def pool(lab, tmp_path_factory):
    """The 2P2D deployment; the module tears it down at its end."""
    tmp = tmp_path_factory.mktemp("pool")
    inv = inventory(tmp, {"prefill": 2, "decode": 2})
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    yield inv, env_client(inv)
    down = fab("teardown", "-i", inv)
    assert down.returncode == 0, down.stdout[-3000:]


# the failed requests' errors (wall clock, what the client raised), for a test that fails
ERRORS: list[tuple[float, str]] = []


def ask(client, i: int, model: str = "zai-org/GLM-5.3-Flash") -> bool:
    try:
        client.chat.completions.create(model=model, max_tokens=8,
                                       messages=[{"role": "user", "content": f"hi {i}"}])
        return True
    except Exception as exc:  # an error of any kind is a failed request
        ERRORS.append((time.time(), f"{type(exc).__name__}: {str(exc)[:300]}"))
        return False


def errors() -> str:
    """The last failed requests: when and why."""
    return "; ".join(f"{time.strftime('%H:%M:%S', time.localtime(t))} {e}"
                     for t, e in ERRORS[-5:])


def test_one_endpoint_spreads_requests_over_every_worker(pool):
    _, client = pool
    for host, units in (("lab1", ["prefill", "decode", "router", "router-1", "gateway"]),
                        ("lab2", ["prefill-1", "decode-1"])):
        for unit in units:
            assert ssh(host, f"systemctl is-active gpufleet-{unit}.service").strip() == \
                "active", f"{host}: gpufleet-{unit}.service"
    before = {w: served(w) for w in WORKERS}
    assert all(ask(client, i) for i in range(8))
    after = {w: served(w) for w in WORKERS}
    # round robin: each prefill and each decode finished some of the 8
    assert all(after[w] > before[w] for w in WORKERS), (before, after)


def test_a_rerun_changes_nothing_on_any_host_nor_the_controller(pool):
    """A no-op deploy of a deployment over two hosts: nothing changes on either host or on
    the controller (the deployment's record once went through an unordered set and was
    rewritten on every run), and no unit restarts."""
    inv, _ = pool
    before = {h: main_pids(h) for h in ("lab1", "lab2")}
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    counts = recap(proc.stdout)
    assert {h: counts[h]["changed"] for h in ("lab1", "lab2", "localhost")} == \
        {"lab1": 0, "lab2": 0, "localhost": 0}, changed_tasks(proc.stdout, "localhost")
    assert {h: main_pids(h) for h in ("lab1", "lab2")} == before


def test_a_killed_decode_worker_leaves_the_pool_within_seconds(pool):
    _, client = pool
    ssh("lab2", "systemctl kill --signal=KILL gpufleet-decode-1.service;"
                " systemctl stop gpufleet-decode-1.service", check=True)
    killed = time.monotonic()
    failed_at = []
    i = 0
    while time.monotonic() - killed < 15:
        if not ask(client, i):
            failed_at.append(time.monotonic() - killed)
        i += 1
        time.sleep(0.1)
    # out of the pool: the router's health check (every 2 s, 2 misses) stops sending there
    print(f"decode-1 killed: {len(failed_at)} of {i} requests failed"
          + (f", the last {failed_at[-1]:.1f} s after the kill" if failed_at else ""))
    assert not failed_at or failed_at[-1] < 10, \
        f"{len(failed_at)} of {i} failed, the last {failed_at[-1]:.1f} s after the kill"
    ssh("lab2", "systemctl start gpufleet-decode-1.service", check=True)
    # back in the pool once it answers the router's health check again
    deadline = time.monotonic() + 90
    before = None
    while before is None and time.monotonic() < deadline:
        try:
            before = served("decode-1")
        except OSError:  # still loading
            time.sleep(1)
    while time.monotonic() < deadline and served("decode-1") <= before:
        ask(client, 0)
    assert served("decode-1") > before, "the restarted decode-1 got no request back"


def restarted(host: str, unit: str) -> str:
    """Restart the unit and wait until its engine serves again: its journal since then."""
    since = time.time()
    ssh(host, f"systemctl restart {unit}", check=True)
    deadline = time.monotonic() + 60
    while not any("startup complete" in m for _, m in unit_events(host, unit, since - 1)):
        assert time.monotonic() < deadline, f"{host}: {unit} did not serve again"
        time.sleep(0.5)
    return ssh(host, f"journalctl -u {unit} --since=@{math.floor(since)} -o cat --no-pager")


def test_a_worker_on_another_host_loads_what_the_first_compiled(pool):
    """The compile cache is on the shared cache, one directory per engine build and GPU
    type: lab1's decode worker compiles its graphs into it, and lab2's, of the same build
    and configuration, loads them instead of compiling."""
    inv, client = pool
    plan = json.loads(fab("plan", "-i", inv, "--format", "json").stdout)
    root = plan["cache"]["compile"] + "/vllm/torch_compile_cache"
    assert plan["cache"]["compile"].endswith("/compile/vllm-0.33.0-h200")
    ssh("lab1", f"rm -rf {root}", check=True)  # nothing compiled yet
    first = restarted("lab1", "gpufleet-decode.service")
    assert f"Using cache directory: {root}/" in first and "Compiling a graph" in first, first
    graphs = ssh("lab2", f"cat {root}/*/rank_0_0/gpufleet-lab-graph.json", check=True)
    assert json.loads(graphs)["host"] == "lab1"  # seen from lab2: the cache is shared
    second = restarted("lab2", "gpufleet-decode-1.service")
    assert "Directly load the compiled graph(s)" in second and "Compiling" not in second, second
    # both back in their pools
    deadline = time.monotonic() + 30
    while not all(ask(client, i) for i in range(4)):
        assert time.monotonic() < deadline, "the pool did not serve again"
        time.sleep(1)


def under_load(client, action, model: str = "zai-org/GLM-5.3-Flash") -> tuple[object, list[bool]]:
    """action() while 4 clients send one request after the other; (its result, each
    request's success)."""
    results: list[bool] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            results.append(ask(client, i, model))
            i += 1

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        out = action()
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return out, results


@pytest.mark.slow  # about 60 s: the failed-canary test below rolls a pool under load the same way
def test_a_rolling_restart_under_load_restarts_every_decode_and_loses_nothing(pool):
    """fab restart --role decode with requests flowing: each decode worker leaves both
    routers' pools, drains, restarts, and is back (each router restarted in turn, the
    gateway's tries going on to the other meanwhile) before the next one leaves."""
    inv, client = pool
    use_up_start_limit("lab2", "gpufleet-decode-1.service")
    before = {h: main_pids(h) for h in ADDRESS}
    gateway_before = ssh("lab1", GATEWAY_STATE)
    assert re.findall(r"server (\S+) max_fails=0( backup)?;", gateway_before) == \
        [("127.0.0.1:8000", "")] * 5 + [("127.0.0.1:8100", " backup")] * 5, gateway_before
    proc, results = under_load(client, lambda: fab("restart", "--role", "decode", "-i", inv))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    after = {h: main_pids(h) for h in ADDRESS}
    for host, unit in (("lab1", "decode"), ("lab2", "decode-1"), ("lab1", "router"),
                       ("lab1", "router-1")):
        u = f"gpufleet-{unit}.service"
        assert after[host][u] != before[host][u], f"{u} was not restarted"
    assert after["lab1"]["gpufleet-prefill.service"] == before["lab1"]["gpufleet-prefill.service"]
    assert after["lab1"]["gpufleet-gateway.service"] == before["lab1"]["gpufleet-gateway.service"]
    # the gateway was left alone (a reload would lose requests sent on its idle
    # connections): the first router, the second as its backup, nginx never reloaded
    assert ssh("lab1", GATEWAY_STATE) == gateway_before
    failed = results.count(False)
    print(f"rolling restart of decode under load: {failed} of {len(results)} requests failed")
    assert len(results) > 100 and failed == 0, (failed, len(results), errors())


def test_a_rolling_restart_of_the_routers_loses_nothing(pool):
    """Each router restarts in turn; the gateway's tries go on to the other meanwhile."""
    inv, client = pool
    before = main_pids("lab1")
    gateway_before = ssh("lab1", GATEWAY_STATE)
    proc, results = under_load(client, lambda: fab("restart", "--role", "router", "-i", inv))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    after = main_pids("lab1")
    assert all(after[u] != before[u] for u in ("gpufleet-router.service",
                                                "gpufleet-router-1.service"))
    assert ssh("lab1", GATEWAY_STATE) == gateway_before
    failed = results.count(False)
    print(f"rolling restart of the routers under load: {failed} of {len(results)} failed")
    assert len(results) > 50 and failed == 0, (failed, len(results), errors())


def use_up_start_limit(host: str, unit: str) -> None:
    """The unit's crash-loop limit used up (StartLimitBurst: 5 starts in 10 min;
    reset-failed zeroes the count): a deliberate restart must still start it."""
    ssh(host, f"u={unit}; systemctl reset-failed $u; "
              "for i in 1 2 3 4 5; do systemctl restart $u; done", check=True)


@pytest.mark.slow  # about 170 s: a deploy under load (fab restart above rolls them the same way)
def test_a_deploy_that_changes_a_decode_flag_restarts_them_in_turn_and_loses_nothing(pool):
    """A changed flag of a pool's workers: the deploy leaves them serving while it runs and
    then restarts them one at a time, each out of both routers' pools meanwhile (as fab
    restart does), while requests flow; nothing else restarts but the routers (in turn)."""
    inv, client = pool
    use_up_start_limit("lab2", "gpufleet-decode-1.service")
    before = {h: main_pids(h) for h in ADDRESS}
    gateway_before = ssh("lab1", GATEWAY_STATE)
    all_yml = Path(inv) / "group_vars" / "all.yml"
    values = yaml.safe_load(all_yml.read_text())
    all_yml.write_text(yaml.safe_dump({**values, "gpufleet_args": {
        "decode": {"--max-num-seqs": 96}}}))
    proc, results = under_load(client, lambda: fab("deploy", "-i", inv))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    after = {h: main_pids(h) for h in ADDRESS}
    decodes = (("lab1", "gpufleet-decode.service"), ("lab2", "gpufleet-decode-1.service"))
    for host, unit in decodes:
        assert after[host][unit] != before[host][unit], f"{unit} was not restarted"
        argv = ssh(host, f"tr '\\0' ' ' < /proc/{after[host][unit]}/cmdline", check=True)
        assert "--max-num-seqs 96" in argv, argv
    for host, unit in (("lab1", "gpufleet-prefill.service"), ("lab2", "gpufleet-prefill-1.service"),
                       ("lab1", "gpufleet-gateway.service")):
        assert after[host][unit] == before[host][unit], f"{unit} was restarted"
    assert ssh("lab1", GATEWAY_STATE) == gateway_before
    # one at a time: the second stopped only once the first ran again (the lab's hosts
    # share one kernel, so their monotonic clocks compare)
    def stopped_and_back(host: str, unit: str) -> tuple[int, int]:
        out = ssh(host, "systemctl show -p ActiveExitTimestampMonotonic "
                        f"-p ActiveEnterTimestampMonotonic {unit}", check=True)
        at = dict(line.split("=", 1) for line in out.split())
        return int(at["ActiveExitTimestampMonotonic"]), int(at["ActiveEnterTimestampMonotonic"])

    first, second = sorted(stopped_and_back(host, unit) for host, unit in decodes)
    assert first[1] < second[0], (first, second)
    failed = results.count(False)
    print(f"deploy of a changed decode flag under load: {failed} of {len(results)} failed")
    assert len(results) > 100 and failed == 0, (failed, len(results), errors())


@pytest.mark.slow  # about 6 minutes: two deploys (test_engine_release.py rolls a release)
def test_a_release_change_stops_every_prefill_and_decode_before_any_starts(pool):
    """A prefill/decode pool moving to another vLLM release and back: its workers are not
    rolled (the routers would pair a new prefill with an old decode worker) but all stop
    before any starts on the new build, and each then reports the plan's release."""
    inv, _ = pool
    all_yml = Path(inv) / "group_vars" / "all.yml"
    values = yaml.safe_load(all_yml.read_text())
    units = [(h, f"gpufleet-{w}.service") for w, (h, _) in WORKERS.items()]
    try:
        for version in ("0.31.0", "0.33.0"):
            all_yml.write_text(yaml.safe_dump(
                {**values, "gpufleet_engine_versions": {"vllm": version}}))
            proc = fab("deploy", "-i", inv)
            assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
            said = " ".join(proc.stdout.split())  # the message as one line, unwrapped
            assert "switch engine build: they restart together" in said, \
                said[said.find("switches build"):][:3000]
            times = []
            for host, unit in units:
                out = ssh(host, "systemctl show -p ActiveExitTimestampMonotonic "
                                f"-p ActiveEnterTimestampMonotonic {unit}", check=True)
                at = dict(line.split("=", 1) for line in out.split())
                times.append((int(at["ActiveExitTimestampMonotonic"]),
                              int(at["ActiveEnterTimestampMonotonic"])))
            # the lab's hosts share one kernel: their monotonic clocks compare
            assert max(e for e, _ in times) < min(s for _, s in times), times
            for worker, (host, port) in WORKERS.items():
                with urllib.request.urlopen(
                        f"http://{ADDRESS[host]}:{port}/version", timeout=5) as r:
                    assert json.loads(r.read())["version"] == version, worker
    finally:
        all_yml.write_text(yaml.safe_dump(values))


@pytest.mark.slow  # about 100 s: one more deploy of the pool, under load
def test_a_lower_count_stops_exactly_the_dropped_workers_and_loses_nothing(pool):
    """prefill-1 dropped under load: both routers let go of it through their API before it
    stops (drained), then take their new lists one at a time behind the gateway."""
    inv, client = pool
    kept = {h: main_pids(h) for h in ADDRESS}
    # the same inventory with a lower count (its own API key stays)
    all_yml = Path(inv) / "group_vars" / "all.yml"
    values = yaml.safe_load(all_yml.read_text())
    all_yml.write_text(yaml.safe_dump({**values, "gpufleet_workers": {"prefill": 1, "decode": 2}}))
    proc, results = under_load(client, lambda: fab("deploy", "-i", inv))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # both routers took a worker out of their pools (gpufleet_pool reports a change only
    # where it sent a call; tests/unit/test_pool_module.py: exactly the dropped ones)
    drop = proc.stdout.split("TASK [Serve | Drop | Out of the routers' pools]", 1)[1]
    assert re.findall(r"^changed: \[lab1\] => \(item=(\S+)\)", drop.split("TASK [", 1)[0],
                      re.M) == ["gpufleet-router.service", "gpufleet-router-1.service"], drop[:3000]
    failed = results.count(False)
    print(f"a lower count under load: {failed} of {len(results)} failed")
    assert len(results) > 50 and failed == 0, (failed, len(results), errors())
    now = {h: main_pids(h) for h in ADDRESS}
    assert "gpufleet-prefill-1.service" not in now["lab2"]
    assert ssh("lab2", "test -e /etc/systemd/system/gpufleet-prefill-1.service; echo $?")\
        .strip() == "1"
    # the workers that stay keep running; the routers take the new list (restarted)
    for host, unit in (("lab1", "prefill"), ("lab1", "decode"), ("lab2", "decode-1")):
        u = f"gpufleet-{unit}.service"
        assert now[host][u] == kept[host][u], f"{u} was restarted"
    for u in ("gpufleet-router.service", "gpufleet-router-1.service"):
        assert now["lab1"][u] != kept["lab1"][u], f"{u} was not restarted"


@pytest.mark.slow  # about 90 s: one more deploy of the pool
def test_a_host_that_leaves_the_group_is_retired(pool):
    """lab2 leaves [workers] (counts 1 and 1, all on lab1): the deploy stops and removes
    lab2's gpufleet units and their configuration (environment files, the gateway's with
    the API key) once the routers have their new lists; lab1 serves (still the pool's form
    at one worker each: both routers, engines on the host's address)."""
    inv, client = pool
    hosts_yml = Path(inv) / "hosts.yml"
    hosts = yaml.safe_load(hosts_yml.read_text())
    hosts["all"]["children"]["workers"] = {"hosts": {"lab1": {}}}
    hosts_yml.write_text(yaml.safe_dump(hosts))
    all_yml = Path(inv) / "group_vars" / "all.yml"
    values = yaml.safe_load(all_yml.read_text())
    all_yml.write_text(yaml.safe_dump({**values, "gpufleet_workers": {"prefill": 1, "decode": 1}}))
    proc = fab("deploy", "-i", inv)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # (gpufleet-lab-hw.service is the lab's simulated hardware, not gpufleet's)
    assert ssh("lab2", "grep -l '^# gpufleet: installed by' /etc/systemd/system/* | wc -l; "
                       "ls /etc/gpufleet/env /etc/gpufleet/gateway 2>/dev/null | wc -l; "
                       "systemctl list-units --plain --no-legend 'gpufleet-*' "
                       "| grep -vc '^gpufleet-lab-'").split() == ["0", "0", "0"]
    assert all(ask(client, i) for i in range(8))
    # the next deploy has nothing to retire: nothing runs on lab2
    again = fab("deploy", "-i", inv)
    assert again.returncode == 0, again.stdout[-3000:]
    assert recap(again.stdout).get("lab2", {}).get("ok", 0) == 0, again.stdout[-3000:]


def unit_events(host: str, unit: str, since: float) -> list[tuple[float, str]]:
    """systemd's stops and starts of the unit since a wall-clock time, and the engine's own
    line when it serves ("Application startup complete."): (seconds, what), from the host's
    journal (the lab's hosts share one clock)."""
    out = ssh(host, f"journalctl -u {unit} --since=@{math.ceil(since)} -o json "
                    "--output-fields=MESSAGE,_PID --no-pager -q", check=True)
    events = []
    for line in out.splitlines():
        entry = json.loads(line)
        message = entry.get("MESSAGE") if isinstance(entry.get("MESSAGE"), str) else ""
        if entry.get("_PID") == "1" and re.match(
                r"(Stopping|Started|Stopped|.*Main process exited|.*Scheduled restart)", message) \
                or "Application startup complete" in message:
            events.append((int(entry["__REALTIME_TIMESTAMP"]) / 1e6, message[:80]))
    return events


# the plan's order alternates the hosts: the first batch of decode workers is one on each
BATCHES = [[("lab1", "gpufleet-decode.service"), ("lab2", "gpufleet-decode-1.service")],
           [("lab2", "gpufleet-decode-2.service")]]
DECODES = [u for batch in BATCHES for u in batch]


def rolled_in_batches(before: dict, action: str, since: float) -> None:
    """The decode workers restarted by ACTION since SINCE in BATCHES: each once, a batch
    together, the next only once the one before serves; the prefill and gateway not."""
    after = {h: main_pids(h) for h in ADDRESS}
    for host, unit in (("lab1", "gpufleet-prefill.service"),
                       ("lab1", "gpufleet-gateway.service")):
        assert after[host][unit] == before[host][unit], f"{action}: {unit} restarted"
    # every stop and start of each worker during the action (systemd's own lines)
    events = {u: unit_events(h, u, since) for h, u in DECODES}
    told = f"{action}: " + "; ".join(f"{u}: {e}" for u, e in events.items())
    stops = {u: [t for t, m in e if m.startswith("Stopping")] for u, e in events.items()}
    starts = {u: [t for t, m in e if m.startswith("Started")] for u, e in events.items()}
    served = {u: [t for t, m in e if "startup complete" in m] for u, e in events.items()}
    # each restarted once by the roll, and nothing else (no crash, no second restart)
    assert all(len(stops[u]) == len(starts[u]) == len(served[u]) == 1
               for _, u in DECODES), told
    assert all(after[h][u] != before[h][u] for h, u in DECODES), told
    first, second = ([u for _, u in batch] for batch in BATCHES)
    # a batch together: all its workers stopped before any served again; the next batch
    # only once every worker of the one before serves
    assert max(stops[u][0] for u in first) < min(served[u][0] for u in first), told
    assert max(served[u][0] for u in first) < min(stops[u][0] for u in second), told


def four_workers(inv: str, flags: bool = False) -> dict:
    """The pool at one prefill and three decode workers over lab1 and lab2, two decode at
    a time (a --slow test before may have retired lab2), deployed; its variables. Without
    FLAGS, the catalog's flags (a test before may have changed one)."""
    hosts_yml = Path(inv) / "hosts.yml"
    hosts = yaml.safe_load(hosts_yml.read_text())
    hosts["all"]["children"]["workers"] = {"hosts": {"lab1": {}, "lab2": {}}}
    hosts_yml.write_text(yaml.safe_dump(hosts))
    all_yml = Path(inv) / "group_vars" / "all.yml"
    values = yaml.safe_load(all_yml.read_text())
    four = {k: v for k, v in values.items() if flags or k != "gpufleet_args"}
    four = {**four, "gpufleet_workers": {"prefill": 1, "decode": 3},
            "gpufleet_max_unavailable": {"decode": 2}}
    if four != values:
        all_yml.write_text(yaml.safe_dump(four))
        proc = fab("deploy", "-i", inv)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return four


@pytest.mark.slow  # about 4 minutes: the failed-canary test below deploys the same shape and
# rolls two workers at a time under load (fab restart; a deploy rolls through the same tasks)
def test_a_pool_rolls_two_workers_at_a_time_under_load_and_loses_nothing(pool):
    """gpufleet_max_unavailable {decode: 2} on one prefill and three decode workers (TP4,
    as many as two 8-GPU hosts take): a deploy that changes the decode flag restarts them
    in two batches, the first two workers (one per host) out of the routers' pools and
    restarting together, the third only once both serve again; 0 failed requests under
    load."""
    inv, client = pool
    four = four_workers(inv)
    before = {h: main_pids(h) for h in ADDRESS}
    changed = {**four, "gpufleet_args": {"decode": {"--max-num-seqs": 96}}}
    (Path(inv) / "group_vars" / "all.yml").write_text(yaml.safe_dump(changed))
    started, since = time.monotonic(), time.time()
    proc, results = under_load(client, lambda: fab("deploy", "-i", inv))
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # the plan's batches 2 and 3 (0 and 1 are the routers'); the prefill (4) is not rolled
    assert "Roll | Restart, batch 3" in proc.stdout and "batch 4" not in proc.stdout
    rolled_in_batches(before, "deploy", since)
    failed = results.count(False)
    print(f"deploy of a changed decode flag, 3 workers 2 at a time, under load: {failed} of "
          f"{len(results)} failed, {took:.0f} s")
    assert len(results) > 100 and failed == 0, (failed, len(results), errors())


@pytest.mark.slow  # about 70 s: the failed-canary test below rolls them the same way
def test_fab_restart_rolls_two_workers_at_a_time_under_load_and_loses_nothing(pool):
    """fab restart --role decode rolls the workers in the batches a deploy does, even a
    unit whose crash-loop limit is used up, and leaves the gateway alone."""
    inv, client = pool
    four_workers(inv, flags=True)
    # a deliberate restart must start a unit whose crash-loop limit is used up; the last
    # of those restarts serves (2 s) before the roll's window opens
    use_up_start_limit("lab2", "gpufleet-decode-1.service")
    time.sleep(5)
    before = {h: main_pids(h) for h in ADDRESS}
    gateway_before = ssh("lab1", GATEWAY_STATE)
    started, since = time.monotonic(), time.time()
    proc, results = under_load(client, lambda: fab("restart", "--role", "decode", "-i", inv))
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rolled_in_batches(before, "fab restart", since)
    # the gateway was left alone (a reload would lose requests sent on its idle
    # connections): nginx never reloaded
    assert ssh("lab1", GATEWAY_STATE) == gateway_before
    failed = results.count(False)
    print(f"fab restart --role decode, 3 workers 2 at a time, under load: {failed} of "
          f"{len(results)} failed, {took:.0f} s")
    assert len(results) > 100 and failed == 0, (failed, len(results), errors())


def test_a_failed_canary_stops_the_roll_with_the_later_workers_serving(pool):
    """The first batch is the canary: when one of its workers does not start again, fab
    restart stops there, names the batch and the fix, and leaves the later batch's worker
    serving as it was; requests go on to the workers that serve."""
    inv, client = pool
    four_workers(inv, flags=True)
    # lab1's decode worker cannot start again (as with a broken engine environment)
    broken = "/run/systemd/system/gpufleet-decode.service.d"
    ssh("lab1", f"mkdir -p {broken} && printf '[Service]\\nExecStartPre=/bin/false\\n' "
                f"> {broken}/broken.conf && systemctl daemon-reload", check=True)
    try:
        before = {h: main_pids(h) for h in ADDRESS}
        proc, results = under_load(client, lambda: fab("restart", "--role", "decode",
                                                       "-i", inv))
        after = {h: main_pids(h) for h in ADDRESS}
    finally:
        ssh("lab1", f"rm -r {broken} && systemctl daemon-reload && systemctl reset-failed "
                    "gpufleet-decode.service; systemctl restart gpufleet-decode.service",
            check=True)
    assert proc.returncode != 0
    assert ("The canary batch (lab1:gpufleet-decode.service, lab2:gpufleet-decode-1.service)"
            " did not serve again") in proc.stdout, proc.stdout[-4000:]
    assert "Fix: fab logs --role decode" in proc.stdout
    assert "Roll | Restart, batch 3" not in proc.stdout
    # each router, restarted after the failed batch with the worker that did not come back
    # on its flags, was waited for until its health check had failed that worker, before
    # the next router restarted (else the gateway has neither to send to: 502s)
    for router in ("gpufleet-router.service", "gpufleet-router-1.service"):
        assert f"Until it routes only to workers that serve: {router}" in proc.stdout
    # the canary's other worker restarted and serves; the later batch's was left alone
    assert "gpufleet-decode.service" not in after["lab1"]
    assert after["lab2"]["gpufleet-decode-1.service"] != before["lab2"]["gpufleet-decode-1.service"]
    assert after["lab2"]["gpufleet-decode-2.service"] == before["lab2"]["gpufleet-decode-2.service"]
    failed = results.count(False)
    print(f"fab restart --role decode with a failed canary, under load: {failed} of "
          f"{len(results)} failed")
    assert len(results) > 100 and failed == 0, (failed, len(results), errors())

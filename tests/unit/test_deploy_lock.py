"""One change of a deployment at a time: fab holds the deployment's controller lock while
a deploy, restart or teardown runs (a second says who holds it and changes nothing), and
each host's deploy lock (gpufleet_host_lock) stops a deploy from another controller;
the health checker neither restarts nor drains while a deploy holds its host
(test_healthcheck.py::test_the_checker_keeps_its_hands_off_while_a_deploy_holds_the_host)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_a_second_deploy_of_a_deployment_says_who_holds_it(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "NO_COLOR": "1"}
    lock = tmp_path / "gpufleet" / "locks" / "sample.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(json.dumps({"what": "fab deploy h200-pd-1node", "pid": 4242,
                               "user": "alice", "since": "2026-12-04 10:00:00 UTC"}))
        held.flush()
        for args in (["deploy", "--target", "h200-pd-1node"], ["restart"], ["teardown"]):
            proc = subprocess.run([str(BIN / "fab"), *args, "-i", "inventories/sample"],
                                  cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=120)
            said = proc.stdout + proc.stderr
            assert proc.returncode == 2, said
            assert "another run changes this deployment: fab deploy h200-pd-1node by alice, " \
                "pid 4242, since 2026-12-04 10:00:00 UTC" in said, said
            assert "deploying" not in proc.stdout and "PLAY [" not in said
    # --check changes nothing: it takes no lock
    assert "--check" in subprocess.run([str(BIN / "fab"), "--help", "deploy"], cwd=ROOT,
                                       env=env, capture_output=True, text=True).stdout


def module(tmp_path, holder, state="held", ttl=3600):
    proc = subprocess.run(
        [str(BIN / "ansible"), "localhost", "-c", "local", "-m",
         "gpufleet.fleet.gpufleet_host_lock", "-a",
         json.dumps({"holder": holder, "state": state, "ttl_s": ttl,
                     "path": str(tmp_path / "run" / "deploy.lock")})],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
             "ANSIBLE_STDOUT_CALLBACK": "json", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
             "ANSIBLE_LOCALHOST_WARNING": "0"})
    out = json.loads(proc.stdout)
    return next(iter(out["plays"][0]["tasks"][0]["hosts"].values()))


def test_the_host_lock_stops_another_controller_and_lets_its_holder_take_it_again(tmp_path):
    path = tmp_path / "run" / "deploy.lock"
    held = module(tmp_path, "alice@ctl1")
    assert not held.get("failed") and not held["changed"], held
    lock = json.loads(path.read_text())
    assert lock["holder"] == "alice@ctl1" and lock["expires"] - time.time() > 3500
    other = module(tmp_path, "bob@ctl2")
    assert other.get("failed") and "another deploy holds this host: alice@ctl1 since " in \
        other["msg"] and f"remove {path}" in other["msg"], other
    assert json.loads(path.read_text())["holder"] == "alice@ctl1"
    # its own earlier run, killed: taken again; released: gone
    assert not module(tmp_path, "alice@ctl1").get("failed")
    assert not module(tmp_path, "alice@ctl1", "released").get("failed")
    assert not path.exists()
    # an expired lock (a deploy that died long ago) stops nobody
    module(tmp_path, "alice@ctl1", ttl=0)
    assert not module(tmp_path, "bob@ctl2").get("failed")
    assert json.loads(path.read_text())["holder"] == "bob@ctl2"

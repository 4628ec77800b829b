#!/usr/bin/env python3
"""Steady load through one endpoint of a gpufleet_workers deployment while its workers are
restarted or one of its hosts is lost. Prints one JSON document.

    python3 bench/scale_out.py -i INVENTORY [--concurrency 4] [--seconds 40] \\
        [--restart-role decode | --lose-host lab2 | --deploy CHANGED_INVENTORY]

The load: CONCURRENCY clients, each sending one chat request after the other (8 tokens,
no retries, the official openai client) for SECONDS, and 5 s past the end of a restart or
deploy. Once the load has run 5 s, either `fab restart --role ROLE -i INVENTORY` runs (a
rolling restart), or `fab deploy -i OTHER` (the same deployment with a change, e.g. a
flag; OTHER may be INVENTORY, edited), or every engine unit of HOST is killed
with SIGKILL and kept stopped (a host cut off; started again at the end); with none of
them, the load alone (throughput: compare a pool of N workers with one). Reported:
requests, failed ones, the failure rate, the seconds from the event to the last failure
(how long until the router routed around it), requests per second.
Runs on the controller (the lab's, or a site's with ssh access to its hosts).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

from openai import DefaultHttpxClient, OpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAB = os.path.join(os.path.dirname(sys.executable), "fab")
sys.path.insert(0, os.path.join(ROOT, "lab"))
try:
    from gpufleet_lab import hosts as lab_hosts  # the lab's ssh config where there is a lab
except ImportError:
    lab_hosts = None


def endpoint(inventory: str) -> dict:
    out = subprocess.run([FAB, "endpoint", "-i", inventory, "--format", "env"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.split())


def client(inventory: str) -> tuple[OpenAI, str]:
    """The OpenAI client a user sets up from `fab endpoint --format env` (the gateway's
    key and its certificate authority; no retries), and the served model's name."""
    env = endpoint(inventory)
    return OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"],
                  max_retries=0, timeout=60, http_client=DefaultHttpxClient(
                      verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"]))), \
        model(inventory)


def model(inventory: str) -> str:
    out = subprocess.run([FAB, "plan", "-i", inventory, "--format", "json"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["model"]["served_name"]


def ssh(host: str, command: str) -> str:
    argv = lab_hosts.ssh_cmd(host, command) if lab_hosts else ["ssh", host, command]
    return subprocess.run(argv, check=True, capture_output=True, text=True,
                          timeout=120).stdout


def under_load(client: OpenAI, name: str, concurrency: int, event, seconds: float = 0,
               lead: float = 5, tail: float = 5) -> tuple[list[tuple[float, str]], float, float]:
    """Steady load while event() runs: CONCURRENCY clients, each sending one chat request
    after the other (8 tokens, no retries); event() after LEAD seconds of it, the load on
    for SECONDS in all and at least TAIL seconds past the event's end. Returns each
    request's (seconds since the start, "" or its error), the event's start and the load's
    seconds."""
    results: list[tuple[float, str]] = []
    lock, start = threading.Lock(), time.monotonic()
    stop = threading.Event()

    def load(k: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                client.chat.completions.create(
                    model=name, max_tokens=8,
                    messages=[{"role": "user", "content": f"client {k} request {i}"}])
                error = ""
            except Exception as exc:  # any error is a failed request
                # the cause tells a connection refused from one closed without an answer
                cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" \
                    if exc.__cause__ else ""
                error = f"{type(exc).__name__}: {str(exc)[:120]}{cause[:160]}"
            with lock:
                results.append((time.monotonic() - start, error))
            i += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    try:
        time.sleep(lead)
        at = time.monotonic() - start
        event()
        time.sleep(max(seconds - (time.monotonic() - start), tail))
    finally:
        stop.set()
        for t in threads:
            t.join()
    return results, at, time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-i", "--inventory", required=True)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seconds", type=float, default=40)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--restart-role")
    kind.add_argument("--lose-host")
    kind.add_argument("--deploy", metavar="INVENTORY",
                       help="fab deploy of this inventory: the same deployment with a change")
    args = p.parse_args()

    openai, name = client(args.inventory)
    what = "none (steady load)"
    units = ""

    def event() -> None:
        nonlocal what, units
        if args.restart_role or args.deploy:
            argv = ["restart", "--role", args.restart_role, "-i", args.inventory] \
                if args.restart_role else ["deploy", "-i", args.deploy]
            started = time.monotonic()
            done = subprocess.run([FAB, *argv], cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
            what = f"fab {' '.join(argv[:-2])} (rc {done.returncode}, " \
                   f"{time.monotonic() - started:.1f} s)"
        elif args.lose_host:
            units = " ".join(ssh(args.lose_host, "systemctl list-units --plain --no-legend "
                                 "'gpufleet-prefill*.service' 'gpufleet-decode*.service' "
                                 "'gpufleet-worker*.service'"
                                 " | cut -d' ' -f1").split())
            ssh(args.lose_host, f"systemctl kill --signal=KILL {units}; systemctl stop {units}")
            what = f"every engine unit of {args.lose_host} killed (SIGKILL)"

    wall = time.time()  # the wall clock at the load's start
    results, at, seconds = under_load(openai, name, args.concurrency, event, args.seconds)
    if args.lose_host:
        ssh(args.lose_host, f"systemctl start {units}")
    failed = [t for t, error in results if error]
    errors = collections.Counter(error for _, error in results if error)
    print(json.dumps({
        "event": what, "event_at_s": round(at, 1), "seconds": round(seconds, 1),
        "concurrency": args.concurrency, "requests": len(results), "failed": len(failed),
        "failed_pct": round(100 * len(failed) / max(len(results), 1), 2),
        "last_failure_after_event_s": round(max(failed) - at, 1) if failed else None,
        "requests_per_s": round(len(results) / seconds, 1),
        "failed_after_event_s": [round(t - at, 1) for t in failed[:20]],
        # wall clock (UTC) of the failures, to find them in the hosts' journals
        "failed_at_utc": [datetime.fromtimestamp(wall + t, UTC).strftime("%H:%M:%S.%f")[:-4]
                          for t in failed[:20]],
        "errors": dict(errors.most_common(5)),
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

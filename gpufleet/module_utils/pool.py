"""A pool's routers through their worker API, as vllm-router and sglang-router serve it:
a worker out of their pools and back, the workers a plan drops, and a router that has just
started until it routes only to workers that serve. Stdlib only: the
gpufleet_pool module runs it on the routers' host, on every host Python."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

OK = (200, 202)  # a router that moves a worker in the background answers 202


class PoolError(Exception):
    pass


def request(method, url, body=None, timeout=10.0):
    """(status, parsed JSON or None); status None where the router does not answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read(300)
    except (OSError, ValueError):
        return None, None
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")


def workers(router):
    """The workers a router lists (GET workers_url), None where it does not answer."""
    status, body = request("GET", router["workers_url"])
    if status != 200 or not isinstance(body, dict):
        return None
    return body.get("workers") or []


def listed(listing, url):
    return next((w for w in listing or [] if w.get("url") == url), None)


def others(listing, move):
    """Healthy workers of the moved worker's kind besides it."""
    return sum(1 for w in listing or [] if w.get("worker_type") == move["type"]
               and w.get("url") != move["url"] and w.get("is_healthy"))


def serving(router, move):
    """The router's workers where it lists another healthy worker of the moved one's kind,
    else None."""
    listing = workers(router)
    return listing if others(listing, move) else None


def poll(check, wait_s, interval):
    """check() until it returns something true, for up to wait_s; its last value."""
    deadline = time.monotonic() + wait_s
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def send(call, url, calls, check_mode, body=None):
    calls.append(f"{call['method']} {url}")
    if check_mode:
        return
    status, answer = request(call["method"], url, body)
    if status not in OK:
        raise PoolError(f"{call['method']} {url} answered {status or 'nothing'}"
                        + (f": {answer}" if answer else ""))


def out(move, p, check_mode):
    routers, calls = move["routers"], []
    # every router first: a refusal changes nothing
    listings = []
    for router in routers:
        listing = poll(lambda r=router: serving(r, move), p["wait_s"], p["interval"])
        if not listing:
            raise PoolError(
                f"{router['unit']} has no healthy {move['type']} worker besides {move['url']}; "
                "taking it out now would stop serving. Fix: bring the others back first "
                "(fab status, fab logs), then run the restart again")
        listings.append(listing)
    for call, listing in zip(move["leave"], listings):
        worker = listed(listing, move["url"])
        if worker is not None:  # else out already
            send(call, call["url"].replace(
                "{id}", urllib.parse.quote(str(worker.get("id", "")), safe="")), calls, check_mode)
    if move.get("rejoin") and not check_mode:
        for router in routers:
            if not poll(lambda r=router: listed(workers(r) or [], move["url"]) is None,
                        p["unlist_s"], 1):
                raise PoolError(f"{router['unit']} still lists {move['url']} "
                                f"{p['unlist_s']} s after it was taken out")
    return calls


def back(move, p, check_mode):
    calls = []
    for call, router in zip(move.get("rejoin") or [], move["routers"]):
        if listed(workers(router), move["url"]) is None:
            send(call, call["url"], calls, check_mode, call.get("body") or {})
    if p["wait_s"] > 0 and not check_mode:
        for router in move["routers"]:
            if not poll(lambda r=router: (listed(workers(r), move["url"]) or {}).get("is_healthy"),
                        p["wait_s"], p["interval"]):
                raise PoolError(f"{router['unit']} does not list {move['url']} healthy "
                                f"{p['wait_s']} s after it served again")
    return calls


def unserved(listing, health_path, timeout):
    """The workers a router lists healthy that do not answer their own health check."""
    return [w["url"] for w in listing if w.get("is_healthy") and request(
        "GET", w["url"].rstrip("/") + health_path, timeout=timeout)[0] != 200]


def settled(router, p, check_mode):
    """Wait until the router routes only to workers that serve, and to one at least: a
    router that starts takes every worker of its flags as healthy and sends requests to one
    that is down until its own health check has failed it (seconds), and sglang-router adds
    the workers of its flags in the background after it answers; the next router of the pool
    restarts only then. Sends nothing."""
    if check_mode:
        return []
    last = {}  # its listing (None: it does not answer) and those it lists healthy that do not

    def check():
        last["listing"] = workers(router)
        last["down"] = unserved(last["listing"] or [], p["health_path"], p["interval"] + 1)
        return not last["down"] and any(w.get("is_healthy") for w in last["listing"] or [])
    if poll(check, p["wait_s"], p["interval"]):
        return []
    after = f"{p['wait_s']} s after it started"
    if last["listing"] is None:
        raise PoolError(f"{router['unit']} does not answer {router['workers_url']} {after}. "
                        "Fix: fab logs --role router")
    if last["down"]:
        raise PoolError(
            f"{router['unit']} still lists {', '.join(last['down'])} healthy {after}, though "
            f"it does not answer {p['health_path']}: requests sent there fail. Fix: fab status "
            "names the worker that is down; bring it back (fab logs) or lower "
            "gpufleet_workers, then run the restart again")
    raise PoolError(f"{router['unit']} lists no healthy worker {after}. Fix: fab status names "
                    "the workers that are down; bring them back (fab logs), then run the "
                    "restart again")


def dropped(drop, check_mode):
    calls = []
    listing = workers(drop)
    gone = [w for w in listing or [] if w.get("url") not in drop["keep"]]
    if len(gone) == len(listing or []):
        return calls  # no answer, or a router naming its workers otherwise
    for w in gone:
        url = drop["leave"]["url"].replace(
            "{url}", urllib.parse.quote(w["url"], safe="")).replace(
            "{id}", urllib.parse.quote(str(w.get("id", "")), safe=""))
        send(drop["leave"], url, calls, check_mode)
    return calls

"""Many HTTP and TCP checks at once: what a deploy's verify step asks of an endpoint, a
port or a metrics path, each check its own short request, all side by side (a thread
each, up to 32), so that a deployment's checks cost one module run, not one per port.
Stdlib only (the Ansible module gpufleet_probe runs it on the controller and on every
host Python).

A check is a dict:
  name    what it is, for the result (free text)
  url     an HTTP(S) request: GET, ok when the status is among `status` and, with `match`,
          the first 64 KiB of the body has a line matching that regular expression
  key     send the key (Authorization: Bearer) with the request
  host, port
          a TCP port that must be closed: ok when no connection is accepted within
          `wait` seconds (one try every 0.5 s, each up to 1 s)
"""

from __future__ import annotations

import re
import socket
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

BODY = 65536  # bytes of a body read for `match`


def http(url, headers=None, context=None, timeout=10.0):
    """(status or None, the body's first BODY bytes, an error or "")."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, resp.read(BODY).decode(errors="replace"), ""
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(BODY).decode(errors="replace"), ""
    except urllib.error.URLError as exc:
        return None, "", str(exc.reason)
    except (OSError, ValueError, ssl.SSLError) as exc:
        return None, "", str(exc)


def accepts(host, port, connect_timeout=1.0):
    """Whether a TCP connection to host:port is accepted now."""
    try:
        with socket.create_connection((host, port), timeout=connect_timeout):
            return True
    except OSError:
        return False


def closed(host, port, wait=3.0, interval=0.5):
    """Whether host:port refuses connections within wait seconds (a port closing as the
    check starts counts as closed)."""
    deadline = time.monotonic() + wait
    while accepts(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def check(spec, key=None, context=None, timeout=10.0, wait=3.0):
    """One check's result: the spec as given, with ok, and status and error for a request.
    A check that cannot run is a failed one."""
    out = dict(spec)
    if spec.get("url"):
        headers = {"Authorization": "Bearer " + key} if spec.get("key") and key else {}
        status, body, error = http(spec["url"], headers, context, timeout)
        ok = status in spec.get("status", [200])
        if ok and spec.get("match") and not re.search(spec["match"], body, re.MULTILINE):
            ok, error = False, "no line matches " + spec["match"]
        out.update(ok=ok, status=status, error=error)
    elif spec.get("port"):
        out.update(ok=closed(spec.get("host") or "127.0.0.1", int(spec["port"]), wait))
    else:
        out.update(ok=False, error="a check needs a url or a port")
    return out


def run(specs, key=None, context=None, timeout=10.0, wait=3.0):
    """Every check, side by side; results in the checks' order."""
    if not specs:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(specs))) as pool:
        return list(pool.map(lambda s: check(s, key, context, timeout, wait), specs))

"""gpufleet_probe's checks (gpufleet/module_utils/probes.py) against real sockets: an
endpoint that wants a bearer key, a metrics path, ports that refuse, accept, or close
while the check waits; the checks run side by side; a check that cannot run fails.

Runs under every host Python (scripts/host-pythons): the module runs on the hosts.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpufleet.module_utils import probes

KEY = "k-123"
PROM = "# HELP up whether\n# TYPE up gauge\nup 1\n"


class Handler(BaseHTTPRequestHandler):
    barrier = None  # set by a test: every request waits for the others

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.barrier is not None:
            try:
                self.barrier.wait(timeout=5)
            except threading.BrokenBarrierError:
                self.send_response(500)
                self.end_headers()
                return
        if self.path == "/metrics":
            body, status = PROM, 200
        elif self.path == "/text":
            body, status = "hello\n", 200
        else:
            ok = self.headers.get("Authorization") == "Bearer " + KEY
            body, status = ("{}" if ok else "no key"), (200 if ok else 401)
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    Handler.barrier = None
    srv.shutdown()
    srv.server_close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_key_is_refused_without_it_and_served_with_it(server):
    refused, served, wrong = probes.run([
        {"kind": "refused", "url": server + "/v1/models", "status": [401, 403]},
        {"kind": "served", "url": server + "/v1/models", "key": True},
        {"kind": "served", "url": server + "/v1/models"},  # no key sent
    ], key=KEY)
    assert refused["ok"] and refused["status"] == 401 and refused["kind"] == "refused"
    assert served["ok"] and served["status"] == 200
    assert not wrong["ok"] and wrong["status"] == 401
    assert KEY not in repr([refused, served, wrong])


def test_a_body_must_match_where_asked(server):
    metrics, text = probes.run([
        {"url": server + "/metrics", "match": "^# (HELP|TYPE) "},
        {"url": server + "/text", "match": "^# (HELP|TYPE) "},
    ])
    assert metrics["ok"]
    assert not text["ok"] and text["status"] == 200 and "no line matches" in text["error"]


def test_nothing_answering_is_a_failed_check_with_the_reason():
    (result,) = probes.run([{"url": f"http://127.0.0.1:{free_port()}/x"}], timeout=2)
    assert not result["ok"] and result["status"] is None and result["error"]


def test_a_closed_port_passes_and_a_listening_one_fails():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        closed, open_ = probes.run([{"port": free_port()}, {"host": "127.0.0.1", "port": port}],
                                   wait=1)
    assert closed["ok"] and not open_["ok"]


def test_a_port_that_closes_while_the_check_waits_passes():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    threading.Timer(0.7, listening.close).start()
    assert probes.closed("127.0.0.1", port, wait=3)


def test_the_checks_run_side_by_side(server):
    """Four requests that each wait for the other three: served only when they run at once."""
    Handler.barrier = threading.Barrier(4)
    started = time.monotonic()
    results = probes.run([{"url": server + "/metrics"}] * 4)
    assert [r["ok"] for r in results] == [True] * 4, results
    assert time.monotonic() - started < 5


def test_a_check_with_neither_url_nor_port_fails():
    (result,) = probes.run([{"name": "nothing"}])
    assert not result["ok"] and "url or a port" in result["error"]

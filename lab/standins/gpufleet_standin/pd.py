"""Prefill/decode KV transfer, simulated at the wire.

vLLM + NixlConnector: every NIXL worker listens on its side channel
(VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT, one JSON line per message). The
prefill answers a request with ``kv_transfer_params`` naming its engine id, block ids and
side channel; the decode handshakes there (compatibility hash), then reads the blocks.

SGLang: the prefill serves a bootstrap HTTP server on --disaggregation-bootstrap-port; the
router sends the same request to both sides with bootstrap_host/port/room; the decode
checks the prefill's /route info and fetches the room's KV; the prefill answers once the
KV left (or the decode aborted).
"""

from __future__ import annotations

import hashlib
import json
import socket
import socketserver
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from .replies import JSONHandler


class TransferError(Exception):
    """KV transfer failed; the request fails with this message."""


def compat_hash(compat: dict) -> str:
    return hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]


def differences(local: dict, remote: dict) -> str:
    keys = sorted(set(local) | set(remote))
    return "; ".join(f"{k}: local={local.get(k)!r} remote={remote.get(k)!r}"
                     for k in keys if local.get(k) != remote.get(k))


def prompt_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- vLLM NIXL -----------------------------------------------------------------------
class Nixl:
    def __init__(self, engine_id: str, compat: dict, host: str, port: int, log):
        self.engine_id, self.compat, self.host, self.port, self.log = (
            engine_id, compat, host, port, log)
        self.blocks: dict[int, str] = {}
        self.next_block = 0
        self.lock = threading.Lock()
        self.handshaken: set[tuple[str, int]] = set()

    def listen(self) -> None:
        nixl = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                for line in self.rfile:
                    reply = nixl.answer(json.loads(line))
                    self.wfile.write((json.dumps(reply) + "\n").encode())

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        server = Server((self.host, self.port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def answer(self, msg: dict) -> dict:
        if msg.get("op") == "handshake":
            return {"engine_id": self.engine_id, "compat": self.compat,
                    "compat_hash": compat_hash(self.compat)}
        with self.lock:
            digests = {self.blocks.pop(b, None) for b in msg.get("block_ids") or []}
        if None in digests or len(digests) != 1:
            return {"ok": False, "error": "unknown or already freed block ids"}
        return {"ok": True, "prompt_digest": digests.pop()}

    def store(self, digest: str, n_tokens: int) -> list[int]:
        with self.lock:
            ids = list(range(self.next_block, self.next_block + max(1, -(-n_tokens // 16))))
            self.next_block += len(ids)
            self.blocks.update(dict.fromkeys(ids, digest))
        return ids

    def params(self, block_ids: list[int], request_id: str, tp: int) -> dict:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": block_ids, "remote_engine_id": self.engine_id,
                "remote_request_id": request_id, "remote_host": self.host,
                "remote_port": self.port, "tp_size": tp}

    def pull(self, params: dict, digest: str) -> None:
        """Decode side: handshake with the prefill's side channel, then read the blocks."""
        host, port = params.get("remote_host"), params.get("remote_port")
        try:
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                f = sock.makefile("rw")
                if (host, port) not in self.handshaken:
                    remote = _ask(f, {"op": "handshake", "engine_id": self.engine_id})
                    if remote["compat_hash"] != compat_hash(self.compat):
                        raise TransferError(
                            f"NIXL compatibility hash mismatch with remote engine "
                            f"{remote['engine_id']} at {host}:{port}: local "
                            f"{compat_hash(self.compat)} != remote {remote['compat_hash']} ("
                            f"{differences(self.compat, remote['compat'])})")
                    self.handshaken.add((host, port))
                got = _ask(f, {"op": "read", "block_ids": params.get("remote_block_ids")})
        except OSError as exc:
            raise TransferError(f"NIXL handshake with {host}:{port} failed: {exc}") from exc
        if not got.get("ok"):
            raise TransferError(f"NIXL read from {host}:{port} failed: {got.get('error')}")
        if got["prompt_digest"] != digest:
            raise TransferError("NIXL read returned KV blocks of another prompt")


def _ask(f, msg: dict) -> dict:
    f.write(json.dumps(msg) + "\n")
    f.flush()
    line = f.readline()
    if not line:
        raise OSError("side channel closed the connection")
    return json.loads(line)


# --- SGLang bootstrap ----------------------------------------------------------------
class Bootstrap:
    """Prefill side: rooms of computed KV waiting for their decode."""

    def __init__(self, compat: dict, port: int, timeout: float):
        self.compat, self.port, self.timeout = compat, port, timeout
        self.rooms: dict[int, dict] = {}
        self.cond = threading.Condition()

    def listen(self, host: str) -> None:
        boot = self

        class Handler(JSONHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlparse(self.path)
                if url.path == "/route":
                    return self.send_json(200, {"compat": boot.compat,
                                                "compat_hash": compat_hash(boot.compat)})
                if url.path == "/_lab/kv":
                    room = int(parse_qs(url.query)["room"][0])
                    status, body = boot.fetch(room)
                    return self.send_json(status, body)
                self.send_json(404, {"error": "not found"})

            def do_POST(self):
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if url.path == "/_lab/abort":
                    boot.abort(int(body["room"]), body.get("reason", "aborted by decode"))
                    return self.send_json(200, {"ok": True})
                self.send_json(404, {"error": "not found"})

        server = ThreadingHTTPServer((host, self.port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def _room(self, room: int) -> dict:
        return self.rooms.setdefault(room, {"digest": None, "state": "pending", "reason": None})

    def put_and_wait(self, room: int, digest: str) -> None:
        """Prefill: publish the room's KV and wait until the decode took it."""
        with self.cond:
            entry = self._room(room)
            entry["digest"] = digest
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: entry["state"] != "pending", self.timeout)
            self.rooms.pop(room, None)
        if not ok:
            raise TransferError(f"KV transfer timed out after {self.timeout:.0f}s "
                                f"(bootstrap_room {room}): no decode fetched it")
        if entry["state"] == "aborted":
            raise TransferError(entry["reason"])

    def fetch(self, room: int) -> tuple[int, dict]:
        with self.cond:
            entry = self._room(room)
            ok = self.cond.wait_for(lambda: entry["digest"] or entry["state"] != "pending",
                                    self.timeout)
            if not ok or entry["state"] != "pending":
                return 408, {"error": f"no KV for bootstrap_room {room}"}
            entry["state"] = "sent"
            self.cond.notify_all()
            return 200, {"digest": entry["digest"]}

    def abort(self, room: int, reason: str) -> None:
        with self.cond:
            entry = self._room(room)
            entry.update(state="aborted", reason=reason)
            self.cond.notify_all()


def bootstrap_pull(compat: dict, host: str, port: int, room: int, digest: str,
                   timeout: float) -> None:
    """Decode side: check the prefill's metadata, then fetch the room's KV."""
    base = f"http://{host}:{port}"
    try:
        remote = _get(f"{base}/route", timeout)
        if remote["compat_hash"] != compat_hash(compat):
            reason = (f"KV transfer failed: prefill/decode mismatch for bootstrap_room {room} "
                      f"({differences(compat, remote['compat'])})")
            _post(f"{base}/_lab/abort", {"room": room, "reason": reason}, timeout)
            raise TransferError(reason)
        got = _get(f"{base}/_lab/kv?room={room}", timeout + 5)
    except (OSError, urllib.error.URLError) as exc:
        raise TransferError(f"KV transfer failed: cannot reach bootstrap server {base}: "
                            f"{exc}") from exc
    if got["digest"] != digest:
        raise TransferError(f"KV transfer failed: bootstrap_room {room} holds another prompt")


def _get(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict, timeout: float) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout):
        pass

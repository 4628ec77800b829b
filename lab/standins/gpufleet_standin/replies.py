"""The one way the stand-in's HTTP servers answer with JSON (the engine's API and the
disaggregation bootstrap server both do)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    def send_json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

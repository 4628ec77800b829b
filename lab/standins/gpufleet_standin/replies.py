"""The one way the stand-in's HTTP servers write a response, text or JSON (the engine's
API and the disaggregation bootstrap server)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    def send_text(self, code: int, text: str, ctype: str = "text/plain") -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_json(self, code: int, obj) -> None:
        self.send_text(code, json.dumps(obj), "application/json")

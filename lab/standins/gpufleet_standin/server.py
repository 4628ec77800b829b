"""The HTTP API of the stand-in engines (vLLM and SGLang flavours)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer

from . import model as M
from .metrics import Metrics
from .pd import TransferError, bootstrap_pull, prompt_digest
from .replies import JSONHandler
from .settings import DATA


class Engine:
    """State of one serving process."""

    def __init__(self, settings, facts: dict, version: str):
        self.s, self.facts, self.version = settings, facts, version
        self.spec = DATA["engines"][settings.engine]
        self.metrics = Metrics()
        self.ready = False
        self.dead = False
        self.draining = False  # vLLM --shutdown-timeout: SIGTERM seen, finishing what runs
        self.last_prompt = ""
        self.nixl = None  # pd.Nixl for vLLM + NixlConnector
        self.bootstrap = None  # pd.Bootstrap for an SGLang prefill
        self.compat: dict = {}
        self.created = int(time.time())
        # A GPU's pace, where a benchmark asks for one (GPUFLEET_LAB_STEP_MS, the time of one
        # decode step, each running request gaining a token per step): at most the engine's
        # running-request cap (--max-num-seqs, --max-running-requests) run at once and the
        # others wait, as the engines' schedulers queue them. Unset: answers at once.
        self.step_s = float(settings.env.get("GPUFLEET_LAB_STEP_MS") or 0) / 1000
        cap = settings.get("--max-num-seqs" if self.vllm else "--max-running-requests")
        self.running = threading.BoundedSemaphore(int(cap or 256))

    def pace(self, generated: int) -> None:
        """Take the time the GPU would take for a request of `generated` tokens."""
        if self.step_s:
            with self.running:
                time.sleep(self.step_s * max(generated, 1))

    @property
    def vllm(self) -> bool:
        return self.s.engine == "vllm"

    def log(self, level: str, text: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        print(f"{level} {stamp} [lab-standin] {text}", file=sys.stderr, flush=True)

    # --- parsers -----------------------------------------------------------------------
    def reasoning_on(self) -> bool:
        return self.s.reasoning_parser in self.spec["thinking_reasoning_parsers"]

    def tools_on(self, body: dict) -> bool:
        choice = body.get("tool_choice", "auto")
        if self.vllm and (choice == "required" or isinstance(choice, dict)):
            return True  # vLLM answers these with structured output, no parser needed
        parser_ok = self.s.tool_parser in self.spec["structured_tool_parsers"]
        if self.vllm:
            return parser_ok and bool(self.s.flags.get("--enable-auto-tool-choice"))
        return parser_ok

    # --- request validation ------------------------------------------------------------
    def validate_chat(self, body: dict) -> None:
        images = M.images_of(body.get("messages") or [])
        if images and "image" not in self.facts["modalities"]:
            if self.vllm:
                raise M.RequestError(f"{self.facts['architecture']} is not a multimodal model "
                                     f"({self.s.model} does not accept image input)", 400)
            raise M.RequestError(f"The model {self.s.model} does not support image input "
                                 "(not a multimodal model).", 400)
        limit = self.s.mm_limits.get("image")
        limit = limit.get("count") if isinstance(limit, dict) else limit
        if limit is not None and len(images) > int(limit):
            raise M.RequestError(f"At most {limit} image(s) may be provided in one prompt.",
                                 400)
        for url in images:
            M.check_image(url)
        tools = body.get("tools")
        if self.vllm and tools and body.get("tool_choice", "auto") == "auto" and not (
                self.s.flags.get("--enable-auto-tool-choice") and self.s.tool_parser):
            raise M.RequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                 "--tool-call-parser to be set", 400)

    def check_model_name(self, body: dict) -> None:
        name = body.get("model")
        if self.vllm and name and name not in (self.s.served_name, self.s.model):
            raise M.RequestError(f"The model `{name}` does not exist.", 404)

    def check_length(self, prompt_tokens: int, max_tokens: int | None) -> int:
        limit = self.facts["max_model_len"]
        if max_tokens is None:
            return max(limit - prompt_tokens, 1)
        if prompt_tokens + max_tokens > limit:
            raise M.RequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.", 400)
        return max_tokens

    # --- generation --------------------------------------------------------------------
    def first_request_fault(self) -> None:
        """flashinfer-python and flashinfer-cubin at different versions: the first kernel
        launch faults and the engine core dies, as in the public reports."""
        split = self.facts.get("flashinfer_split")
        if not split:
            return
        self.dead = True
        self.log("ERROR", "EngineCore encountered a fatal error.\nTraceback (most recent call "
                 "last):\n  File \"flashinfer/sparse.py\", in run\ntorch.AcceleratorError: CUDA "
                 "error: an illegal memory access was encountered\nCUDA kernel errors might be "
                 f"asynchronously reported at some other API call ({split})")
        threading.Timer(0.5, os._exit, (1,)).start()
        raise M.RequestError("EngineCore encountered an issue. See stack trace (above) for the "
                             "root cause. (CUDA error: an illegal memory access was "
                             "encountered)", 500)

    def transfer(self, body: dict, digest: str, prompt_tokens: int) -> dict | None:
        """PD hooks before generation; returns kv_transfer_params for a prefill reply."""
        mode = self.s.pd_mode
        if self.vllm and self.nixl:
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_prefill") and mode in ("decode", "both"):
                try:
                    self.nixl.pull(params, digest)
                except TransferError as exc:
                    policy = (self.s.kv_transfer or {}).get("kv_load_failure_policy", "fail")
                    self.log("ERROR", f"KV load failed: {exc}")
                    if policy != "recompute":
                        raise M.RequestError(f"KV transfer failed: {exc}", 500) from exc
                    self.log("WARNING", "kv_load_failure_policy=recompute: recomputing prefill")
            if params.get("do_remote_decode") and mode in ("prefill", "both"):
                return {"block_ids": self.nixl.store(digest, prompt_tokens)}
            return None
        if not self.vllm and mode in ("prefill", "decode"):
            room = body.get("bootstrap_room")
            if room is None:
                raise M.RequestError(f"{mode} server requires bootstrap_host, bootstrap_port "
                                     "and bootstrap_room (send requests through the router)",
                                     400)
            try:
                if mode == "prefill":
                    self.bootstrap.put_and_wait(int(room), digest)
                else:
                    bootstrap_pull(self.compat, body.get("bootstrap_host"),
                                   int(body.get("bootstrap_port")), int(room), digest,
                                   float(os.environ.get("GPUFLEET_LAB_KV_TIMEOUT", "30")))
            except TransferError as exc:
                self.log("ERROR", str(exc))
                raise M.RequestError(str(exc), 500) from exc
        return None

    def prepare_chat(self, body: dict) -> dict:
        self.check_model_name(body)
        self.validate_chat(body)
        kwargs = body.get("chat_template_kwargs") or {}
        prompt = M.render(body.get("messages") or [], body.get("tools"), kwargs)
        self.last_prompt = prompt
        n_prompt = M.count(prompt)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None and not self.vllm:
            max_tokens = (body.get("sampling_params") or {}).get("max_new_tokens")
        max_tokens = self.check_length(n_prompt, max_tokens)
        self.first_request_fault()
        kv = self.transfer(body, prompt_digest(prompt), n_prompt)
        pieces = M.chat_output(body)
        thinking = kwargs.get("enable_thinking", True) is not False
        return {"pieces": pieces, "max_tokens": max_tokens, "prompt_tokens": n_prompt,
                "kv": kv, "thinking": thinking, "tools": self.tools_on(body)
                and bool(body.get("tools")) and body.get("tool_choice") != "none"}

    def shape(self, job: dict) -> dict:
        """Message fields from the emitted tokens, as the configured parsers return them."""
        pieces = job["pieces"][: job["max_tokens"]]
        finish = "length" if len(job["pieces"]) > job["max_tokens"] else "stop"
        reason = "".join(t for k, t in pieces if k == "reason").lstrip()
        ended = any(k == "end_think" for k, _ in pieces)
        after = "".join(t for k, t in pieces if k in ("answer", "tool")).lstrip()
        if self.reasoning_on() and job["thinking"]:
            reasoning, content = reason or None, (after if ended else None)
        else:
            raw = "".join(t for _, t in pieces).lstrip()
            reasoning, content = None, raw
        calls = []
        if job["tools"] and finish == "stop" and content:
            prefix, parsed = M.parse_tool_calls(content)
            if parsed:
                content, finish = (prefix or None), "tool_calls"
                calls = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": n, "arguments": json.dumps(a)}}
                         for n, a in parsed]
        return {"reasoning": reasoning, "content": content, "tool_calls": calls,
                "finish": finish, "generated": len(pieces)}

    def usage(self, prompt: int, generated: int) -> dict:
        return {"prompt_tokens": prompt, "total_tokens": prompt + generated,
                "completion_tokens": generated, "prompt_tokens_details": None}

    def message(self, out: dict) -> dict:
        msg = {"role": "assistant", "content": out["content"],
               "tool_calls": out["tool_calls"] if self.vllm else (out["tool_calls"] or None),
               "reasoning_content": out["reasoning"]}
        if self.vllm:
            msg.update(refusal=None, annotations=None, audio=None, function_call=None,
                       reasoning=out["reasoning"])
        return msg

    def chat_response(self, job: dict, out: dict) -> dict:
        resp = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.s.served_name,
                "choices": [{"index": 0, "message": self.message(out), "logprobs": None,
                             "finish_reason": out["finish"], "stop_reason": None}],
                "usage": self.usage(job["prompt_tokens"], out["generated"])}
        if self.vllm:
            resp.update(service_tier=None, system_fingerprint=None, prompt_logprobs=None,
                        kv_transfer_params=self.kv_params(job))
        else:
            resp["metadata"] = {"weight_version": "default"}
        return resp

    def kv_params(self, job: dict) -> dict | None:
        if not job.get("kv"):
            return None
        return self.nixl.params(job["kv"]["block_ids"], f"cmpl-{uuid.uuid4().hex}",
                                self.s.tp)

    def chat_stream(self, job: dict, include_usage: bool):
        """SSE events (dicts) for a streamed chat completion."""
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        pieces = job["pieces"][: job["max_tokens"]]
        out = self.shape(job)

        def chunk(delta, finish=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": self.s.served_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        separate = self.reasoning_on() and job["thinking"]
        started: set[str] = set()
        for kind, text in pieces:
            if kind == "tool" and out["tool_calls"]:
                continue
            if kind == "end_think" and separate:
                continue
            field = "reasoning_content" if kind == "reason" and separate else "content"
            if field not in started:
                text = text.lstrip()
                started.add(field)
            delta = {field: text}
            if field == "reasoning_content" and self.vllm:
                delta["reasoning"] = text
            yield chunk(delta)
        for i, call in enumerate(out["tool_calls"]):
            yield chunk({"tool_calls": [{"index": i, **call}]})
        yield chunk({"content": ""}, out["finish"])
        if include_usage:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": self.s.served_name, "choices": [],
                   "usage": self.usage(job["prompt_tokens"], out["generated"])}

    def prepare_completion(self, body: dict) -> dict:
        self.check_model_name(body)
        prompt = body.get("prompt") or ""
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else " ".join(
                map(str, prompt))
        self.last_prompt = prompt
        n_prompt = max(M.count(prompt), 1)
        max_tokens = self.check_length(n_prompt, body.get("max_tokens") or 16)
        self.first_request_fault()
        kv = self.transfer(body, prompt_digest(prompt), n_prompt)
        return {"pieces": M.completion_output(prompt), "max_tokens": max_tokens,
                "prompt_tokens": n_prompt, "kv": kv}

    def completion_text(self, job: dict) -> tuple[str, str, int]:
        pieces = job["pieces"][: job["max_tokens"]]
        finish = "length" if len(job["pieces"]) > job["max_tokens"] else "stop"
        return "".join(t for _, t in pieces), finish, len(pieces)


class Handler(JSONHandler):
    protocol_version = "HTTP/1.1"
    engine: Engine = None  # set by serve()

    def log_message(self, fmt, *args):
        self.engine.log("INFO", f'{self.client_address[0]} - "{self.requestline}" {args[1]}'
                        if len(args) > 1 else fmt % args)

    # --- plumbing ----------------------------------------------------------------------
    def send_error_json(self, message: str, code: int) -> None:
        kind = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError"}.get(
            code, "InternalServerError")
        err = {"message": message, "type": kind, "param": None, "code": code}
        self.send_json(code, {"error": err} if self.engine.vllm else {"object": "error", **err})

    def stream(self, events) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            line = event if isinstance(event, bytes) else f"data: {json.dumps(event)}\n\n"
            data = line.encode() if isinstance(line, str) else line
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            raise M.RequestError(f"JSON decode error: {exc}", 400) from exc
        if not isinstance(body, dict):
            raise M.RequestError("Request body must be a JSON object", 400)
        return body

    def authorized(self, path: str) -> bool:
        keys = self.engine.s.api_keys
        if not keys:
            return True
        if self.engine.vllm:
            protected = path.startswith("/v1")
        else:
            protected = not (path.startswith("/health") or path == "/metrics")
        auth = self.headers.get("Authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else self.headers.get("x-api-key", "")
        return not protected or token in keys

    # --- routes ------------------------------------------------------------------------
    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        e = self.engine
        if not self.authorized(path):
            return self.send_json(401, {"error": "Unauthorized"})
        if path.startswith("/health"):
            return self.send_text(503 if not e.ready or e.dead else 200, "")
        # vLLM draining (SIGTERM with --shutdown-timeout): its engine client is shut down,
        # so new work fails with its error, 500, while /health (200), /v1/models and
        # /metrics still answer (real vLLM 0.32.0: tests/integration/test_real_vllm_cpu.py)
        if e.draining and method == "POST":
            return self.send_error_json("cannot schedule new futures after shutdown", 500)
        if not e.ready:
            return self.send_error_json("The server is still starting.", 503)
        handler = ROUTES.get((method, path))
        if handler is None:
            return self.send_json(404, {"detail": "Not Found"})
        try:
            handler(self)
        except M.RequestError as exc:
            self.send_error_json(exc.args[0], exc.args[1])
        except (BrokenPipeError, ConnectionResetError):
            pass

    def r_models(self):
        e = self.engine
        card = {"id": e.s.served_name, "object": "model", "created": e.created,
                "owned_by": e.spec["owned_by"], "root": e.s.model, "parent": None,
                "max_model_len": e.facts["max_model_len"]}
        self.send_json(200, {"object": "list", "data": [card]})

    def r_metrics(self):
        e = self.engine
        if not e.vllm and not e.s.flags.get("--enable-metrics"):
            return self.send_json(404, {"detail": "Not Found"})
        self.send_text(200, e.metrics.render(e.s.engine, e.s.served_name),
                       "text/plain; version=0.0.4; charset=utf-8")

    def r_version(self):
        self.send_json(200, {"version": self.engine.version})

    def r_last_prompt(self):
        self.send_json(200, {"prompt": self.engine.last_prompt})

    def r_model_info(self):
        e = self.engine
        cfg = e.facts["config"]
        self.send_json(200, {
            "model_path": e.s.model, "tokenizer_path": e.s.model, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": "image" in e.facts["modalities"],
            "has_audio_understanding": False, "model_type": cfg.get("model_type"),
            "architectures": cfg.get("architectures")})

    def r_server_info(self):
        e = self.engine
        # typed as SGLang's ServerArgs are (sglang-router reads this into typed fields,
        # and a number given as a string loses the worker's model name)
        args = {k.lstrip("-").replace("-", "_"): _typed(v) for k, v in e.s.flags.items() if k}
        self.send_json(200, {
            **args, "model_path": e.s.model, "served_model_name": e.s.served_name,
            "tp_size": e.s.tp, "dp_size": e.s.num("--dp-size"), "port": e.s.port,
            "disaggregation_mode": e.s.get("--disaggregation-mode"),
            "kv_cache_dtype": e.s.kv_cache_dtype, "version": e.version,
            "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}}]})

    def r_chat(self):
        e = self.engine
        body = self.body()
        start = e.metrics.begin()
        job, out = None, None
        try:
            job = e.prepare_chat(body)
            out = e.shape(job)
            e.pace(out["generated"])
            if body.get("stream"):
                opts = body.get("stream_options") or {}
                events = list(e.chat_stream(job, bool(opts.get("include_usage"))))
                self.stream([*events, b"data: [DONE]\n\n"])
            else:
                self.send_json(200, e.chat_response(job, out))
        finally:
            e.metrics.end(start, job["prompt_tokens"] if job else 0,
                          out["generated"] if out else 0, out["finish"] if out else None,
                          stream=bool(body.get("stream")))

    def r_completions(self):
        e = self.engine
        body = self.body()
        start = e.metrics.begin()
        result = None
        job = None
        try:
            job = e.prepare_completion(body)
            text, finish, n = result = e.completion_text(job)
            e.pace(n)
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None, "prompt_logprobs": None}
            resp = {"id": rid, "object": "text_completion", "created": created,
                    "model": e.s.served_name, "choices": [choice],
                    "usage": e.usage(job["prompt_tokens"], n)}
            if e.vllm:
                resp["kv_transfer_params"] = e.kv_params(job)
            if body.get("stream"):
                pieces = job["pieces"][: job["max_tokens"]]
                events = [{**resp, "choices": [{**choice, "text": t, "finish_reason": None}]}
                          for _, t in pieces]
                events.append({**resp, "choices": [{**choice, "text": ""}]})
                for ev in events:
                    ev.pop("usage", None)
                self.stream([*events, b"data: [DONE]\n\n"])
            else:
                self.send_json(200, resp)
        finally:
            e.metrics.end(start, job["prompt_tokens"] if job else 0, result[2] if result else 0,
                          result[1] if result else None, stream=bool(body.get("stream")))

    def r_generate(self):
        """SGLang's native /generate (what the router forwards for it)."""
        e = self.engine
        body = self.body()
        params = body.get("sampling_params") or {}
        start = e.metrics.begin()
        job, result = None, None
        try:
            job = e.prepare_completion({"prompt": body.get("text") or "",
                                        "max_tokens": params.get("max_new_tokens") or 128,
                                        **{k: v for k, v in body.items() if k.startswith("boot")}})
            text, finish, n = result = e.completion_text(job)
            self.send_json(200, {"text": text, "meta_info": {
                "id": uuid.uuid4().hex, "finish_reason": {"type": finish},
                "prompt_tokens": job["prompt_tokens"], "completion_tokens": n,
                "cached_tokens": 0}})
        finally:  # the router's requests are the engine's: counted as SGLang counts them
            e.metrics.end(start, job["prompt_tokens"] if job else 0, result[2] if result else 0,
                          result[1] if result else None, stream=bool(body.get("stream")))

    def r_messages(self):
        """Anthropic /v1/messages on top of the chat path."""
        from .anthropic import to_chat, to_message  # small, only loaded when used

        e = self.engine
        body = self.body()
        chat = to_chat(body)
        start = e.metrics.begin()
        job, out = None, None
        try:
            job = e.prepare_chat(chat)
            out = e.shape(job)
            msg = to_message(out, e.s.served_name, job["prompt_tokens"])
            if body.get("stream"):
                from .anthropic import stream_events

                return self.stream(list(stream_events(msg)))
            self.send_json(200, msg)
        finally:
            e.metrics.end(start, job["prompt_tokens"] if job else 0,
                          out["generated"] if out else 0, out["finish"] if out else None,
                          stream=bool(body.get("stream")))


ROUTES = {
    ("GET", "/v1/models"): Handler.r_models,
    ("GET", "/metrics"): Handler.r_metrics,
    ("GET", "/version"): Handler.r_version,
    ("GET", "/_lab/last_prompt"): Handler.r_last_prompt,
    ("POST", "/v1/chat/completions"): Handler.r_chat,
    ("POST", "/v1/completions"): Handler.r_completions,
    ("POST", "/v1/messages"): Handler.r_messages,
}
SGLANG_ROUTES = {
    ("GET", "/get_model_info"): Handler.r_model_info,
    ("GET", "/model_info"): Handler.r_model_info,
    ("GET", "/get_server_info"): Handler.r_server_info,
    ("GET", "/server_info"): Handler.r_server_info,
    ("POST", "/generate"): Handler.r_generate,
}


def _typed(value):
    """A flag's value as argparse's type would make it: an int or float where it reads as
    one (SGLang's numeric options), else as given."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def serve(engine: Engine) -> ThreadingHTTPServer:
    if not engine.vllm:
        ROUTES.update(SGLANG_ROUTES)
    handler = type("BoundHandler", (Handler,), {"engine": engine})
    server = ThreadingHTTPServer((engine.s.host, engine.s.port), handler)
    server.daemon_threads = True
    return server

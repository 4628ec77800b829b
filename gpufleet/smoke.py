"""Smoke test: a real OpenAI client against a deployment's /v1 endpoint.

Every promise of the recipes (the vLLM, Dynamo and SGLang recipes, seeds 000, 002 and 004
in docs/recipes.md) is one named check: the model is listed, "Reply with exactly: READY"
answers, streaming, completions, reasoning kept out of content, tool calls parsed,
JSON-schema output, SGLang's Anthropic /v1/messages, one image per prompt, and
clear_thinking on a second turn. A failed check says what
came back and the likely cause (usually a missing engine flag).

    python -m gpufleet.smoke --url http://host:8000/v1 --model zai-org/GLM-5.3-Flash \
        --engine vllm [--multimodal --image-limit 1] [--api-key-file F] [--json]
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import re
import ssl
import struct
import sys
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import asdict, dataclass

import openai

ENGINES = ("vllm", "sglang", "dynamo")
READY = [{"role": "user", "content": "Reply with exactly: READY"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "population": {"type": "integer"},
                                           "capital": {"type": "boolean"}},
          "required": ["name", "population", "capital"]}
# The flag that fixes each failure, per engine (Dynamo's worker prefixes its parsers).
REASONING_FLAG = {"vllm": "--reasoning-parser glm45", "sglang": "--reasoning-parser glm45",
                  "dynamo": "--dyn-reasoning-parser glm45"}
TOOL_FLAG = {"vllm": "--tool-call-parser glm47", "sglang": "--tool-call-parser glm47",
             "dynamo": "--dyn-tool-call-parser glm47"}
IMAGE_LIMIT_FLAG = {"vllm": "--limit-mm-per-prompt", "dynamo": "--limit-mm-per-prompt",
                    "sglang": "--limit-mm-data-per-request"}
ANSWER_TOKENS = 1024  # room for low-effort reasoning plus an answer on a real model
# Why the checks that read an answer are skipped for a model of random weights (the lab's
# real-engine model): it generates tokens but cannot follow a prompt, reason or call a tool.
# What it still proves: the model listed, the key refused, a completion and a whole stream
# generated, and the engine started with the target's parser flags.
RANDOM = "skip: the model has random weights (it cannot follow a prompt)"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    cause: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("ok" if self.ok else "FAIL")


class Failed(Exception):
    """A check's failure: (detail, likely cause)."""


def png(size: int = 8) -> bytes:
    """A tiny valid RGB PNG (a red/blue checkerboard), stdlib only."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    rows = b"".join(b"\x00" + b"".join(b"\xff\x00\x00" if (x + y) % 2 else b"\x00\x00\xff"
                                       for x in range(size)) for y in range(size))
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def image_url() -> str:
    return "data:image/png;base64," + base64.b64encode(png()).decode()


def _reasoning(obj) -> str:
    """reasoning_content (vLLM/SGLang/Dynamo) or reasoning (newer vLLM) of a message/delta."""
    extra = getattr(obj, "model_extra", None) or {}
    return extra.get("reasoning_content") or extra.get("reasoning") or ""


def _short(text, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def _answer(content: str | None) -> str:
    """The answer part of content (after a stray </think> when reasoning is mixed in)."""
    return (content or "").split("</think>")[-1].strip()


def _is_ready(content: str | None) -> bool:
    return re.fullmatch(r"\W*READY\W*", _answer(content)) is not None


class Smoke:
    def __init__(self, base_url: str, model: str, engine: str, api_key: str | None,
                 timeout: float, ca_file: str | None = None):
        base = base_url.rstrip("/")
        self.v1 = base if base.endswith("/v1") else base + "/v1"
        self.root = self.v1[: -len("/v1")]
        self.model, self.engine, self.timeout = model, engine, timeout
        self.key, self.ca_file = api_key, ca_file
        # an https endpoint's certificate is verified as a client verifies it: with the
        # deployment's CA where it has one, else the system's trust store
        self.tls = ssl.create_default_context(cafile=ca_file) if self.v1.startswith(
            "https:") else None
        self.client = openai.OpenAI(
            base_url=self.v1, api_key=api_key or "EMPTY", timeout=timeout, max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=self.tls) if self.tls else None)

    def chat(self, messages, effort: str | None = "low", max_tokens: int = ANSWER_TOKENS,
             **kw):
        kwargs = dict(kw.pop("template", {}))
        if effort:
            kwargs["reasoning_effort"] = effort
        extra = {"chat_template_kwargs": kwargs} if kwargs else None
        return self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, extra_body=extra, **kw)

    def http(self, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        """(status, text) for what the client has no call for; never raises on HTTP codes."""
        headers = {"Content-Type": "application/json", "anthropic-version": "2023-06-01"}
        if self.key:
            headers.update({"Authorization": f"Bearer {self.key}", "x-api-key": self.key})
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.root + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.tls) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")


def _unreachable(exc: BaseException) -> str:
    """The likely cause of a request that got no HTTP answer."""
    if "CERTIFICATE_VERIFY_FAILED" in f"{exc} {exc.__cause__}":
        return ("the endpoint's certificate does not verify with the CA given (--ca-file; "
                "fab endpoint prints the deployment's)")
    return "is the router/engine running and listening there?"


def _truncated(choice, max_tokens: int, what: str = "answering") -> Failed | None:
    """The reasoning-ran-out failure, when that is what happened."""
    message = choice.message
    if choice.finish_reason == "length" and not _answer(message.content) and _reasoning(
            message):
        return Failed(f"reasoning used all {max_tokens} tokens before {what}",
                      "raise max_tokens or lower reasoning_effort")
    return None


# --- the checks (each returns a detail string or raises Failed) ----------------------
def check_models(s: Smoke, **_) -> str:
    ids = [m.id for m in s.client.models.list().data]
    if s.model not in ids:
        raise Failed(f"{s.model!r} not in /v1/models {ids}",
                     "--served-model-name differs from the name clients use")
    return f"{s.model} listed"


def check_key(s: Smoke, **_) -> str:
    """The endpoint refuses what comes without the key: the model list and a generation."""
    if not s.key:
        return "skip: the deployment takes no API key"
    bare = Smoke(s.root, s.model, s.engine, None, s.timeout, s.ca_file)
    body = {"model": s.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for method, path, data in (("GET", "/v1/models", None),
                               ("POST", "/v1/chat/completions", body)):
        status = bare.http(method, path, data)[0]
        if status not in (401, 403):
            raise Failed(f"{method} {path} without the API key answered {status}",
                         "the endpoint is not behind the gateway: is gpufleet-gateway "
                         "active, and does another process hold its port?")
    return "refused without the key (models, chat)"


def check_ready(s: Smoke, ready_max_tokens: int = 64, ready_effort: str | None = "low",
                answers: bool = True, **_) -> str:
    if not answers:
        return RANDOM
    sent = f"temperature=0 max_tokens={ready_max_tokens}"
    if ready_effort:
        sent += f" chat_template_kwargs.reasoning_effort={ready_effort}"
    reply = s.chat(READY, ready_effort, ready_max_tokens, temperature=0)
    choice = reply.choices[0]
    cut = _truncated(choice, ready_max_tokens)
    if cut:
        raise Failed(f"{cut.args[0]} (sent {sent})", cut.args[1])
    if not _is_ready(choice.message.content):
        raise Failed(f"no READY in content {_short(choice.message.content)} "
                     f"(finish {choice.finish_reason}; sent {sent})",
                     "the model does not follow the prompt: wrong checkpoint or chat template?")
    return f"READY (finish {choice.finish_reason}; sent {sent})"


def check_stream(s: Smoke, answers: bool = True, **_) -> str:
    deadline = time.monotonic() + s.timeout
    n, content, thought, finish = 0, "", "", None
    # a random model's reply is not read: a few tokens show the stream whole
    tokens = ANSWER_TOKENS if answers else 16
    stream = s.chat(READY, max_tokens=tokens, temperature=0, stream=True)
    with stream:
        for chunk in stream:
            if time.monotonic() > deadline:
                raise Failed(f"stream still running after {s.timeout:g}s ({n} chunks)",
                             "a proxy or router is buffering or stalling the stream")
            for choice in chunk.choices:
                n += 1
                content += choice.delta.content or ""
                thought += _reasoning(choice.delta)
                finish = choice.finish_reason or finish
    if n < 2 or finish is None:
        raise Failed(f"{n} chunks, finish_reason {finish}",
                     "the stream was cut: router/proxy timeout or an engine error")
    if not answers:
        return f"{n} chunks, finish {finish} (the answer not read: random weights)"
    if finish == "length" and not _answer(content) and thought:
        raise Failed(f"reasoning used all {ANSWER_TOKENS} tokens before answering",
                     "raise max_tokens or lower reasoning_effort")
    if not _is_ready(content):
        raise Failed(f"{n} chunks but no READY in {_short(content)} (finish {finish})",
                     "the streamed answer differs from the non-streamed one")
    return f"{n} chunks, READY, finish {finish}"


def check_completions(s: Smoke, **_) -> str:
    reply = s.client.completions.create(model=s.model, prompt="The capital of France is",
                                        max_tokens=16, temperature=0)
    text = reply.choices[0].text
    if not (text or "").strip():
        raise Failed("empty completion", "the engine generated nothing: check its log")
    return f"{_short(text, 40)} (finish {reply.choices[0].finish_reason})"


def check_reasoning(s: Smoke, reasoning_parser: bool = True, answers: bool = True,
                    **_) -> str:
    if not reasoning_parser:
        return "skip: the target sets no reasoning parser"
    if not answers:
        return RANDOM
    fix = f"is {REASONING_FLAG[s.engine]} set?"
    choice = s.chat([{"role": "user", "content": "What is 15% of 240?"}]).choices[0]
    content, thought = choice.message.content or "", _reasoning(choice.message)
    if "</think>" in content or "<think>" in content:
        raise Failed(f"reasoning mixed into content: {fix} (content {_short(content)})", fix)
    cut = _truncated(choice, ANSWER_TOKENS)
    if cut:
        raise Failed(*cut.args)
    if not thought:
        raise Failed(f"no reasoning_content/reasoning in the reply: {fix}", fix)
    if not content.strip():
        raise Failed(f"reasoning but no answer (finish {choice.finish_reason})",
                     "raise max_tokens or lower reasoning_effort")
    return f"{len(thought.split())} words of reasoning apart from the answer"


def check_tool_call(s: Smoke, tool_parser: bool = True, answers: bool = True, **_) -> str:
    if not tool_parser:
        return "skip: the target sets no tool-call parser"
    if not answers:
        return RANDOM
    fix = f"is {TOOL_FLAG[s.engine]} set?"
    if s.engine == "vllm":
        fix = f"is {TOOL_FLAG['vllm']} --enable-auto-tool-choice set?"
    try:
        choice = s.chat([{"role": "user", "content": "What's the weather in Paris?"}],
                        tools=WEATHER).choices[0]
    except openai.BadRequestError as exc:
        raise Failed(f"tools refused: {_short(exc.message, 120)}", fix) from None
    content, calls = choice.message.content or "", choice.message.tool_calls or []
    if "<tool_call>" in content:
        raise Failed(f"tool call came back as text: {fix} (content {_short(content)})", fix)
    if not calls:
        cut = _truncated(choice, ANSWER_TOKENS, "calling the tool")
        if cut:
            raise Failed(*cut.args)
        raise Failed(f"no tool_calls (finish {choice.finish_reason}, content "
                     f"{_short(content)})", fix)
    call = calls[0].function
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        args = None
    if call.name != "get_weather" or not isinstance(args, dict) or "city" not in args:
        raise Failed(f"unexpected call {call.name}({_short(call.arguments)})",
                     "the tool-call parser does not match the model: glm47 for GLM-5.3")
    if choice.finish_reason != "tool_calls":
        raise Failed(f"tool_calls present but finish_reason {choice.finish_reason!r}",
                     "agent loops wait for finish_reason tool_calls: engine/router bug?")
    return f"get_weather({json.dumps(args)}), finish tool_calls"


def check_json_schema(s: Smoke, answers: bool = True, **_) -> str:
    if not answers:
        return RANDOM
    choice = s.chat([{"role": "user", "content": "Describe one large city as JSON."}],
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "city", "schema": SCHEMA}}).choices[0]
    content = choice.message.content or ""
    try:
        data = json.loads(content)
    except ValueError:
        cause = "is structured output (the engine's grammar backend) enabled?"
        if "</think>" in content:
            cause = f"reasoning mixed into content: is {REASONING_FLAG[s.engine]} set?"
        cut = _truncated(choice, ANSWER_TOKENS)
        if cut:
            raise Failed(*cut.args) from None
        raise Failed(f"answer is not JSON: {_short(content)}", cause) from None
    missing = [k for k in SCHEMA["required"] if not isinstance(data, dict) or k not in data]
    if missing:
        raise Failed(f"JSON lacks required {missing}: {_short(content)}",
                     "response_format json_schema was not enforced")
    return f"parsed, has {', '.join(SCHEMA['required'])}"


def check_messages(s: Smoke, **_) -> str:
    if s.engine != "sglang":
        return "skip: /v1/messages is an SGLang promise (004)"
    if not getattr(s, "anthropic", True):
        return "skip: sglang-router 0.3.2 does not route /v1/messages (the plan warns)"
    status, text = s.http("POST", "/v1/messages", {"model": s.model, "max_tokens": 512,
                                                   "messages": READY})
    if status != 200:
        raise Failed(f"/v1/messages answered {status}: {_short(text, 120)}",
                     "the Anthropic endpoint is missing: SGLang server or router too old?")
    try:
        msg = json.loads(text)
    except ValueError:
        raise Failed(f"not JSON: {_short(text)}", "a proxy answered instead of SGLang") from None
    blocks = [b.get("type") for b in msg.get("content") or []]
    if msg.get("type") != "message" or not blocks:
        raise Failed(f"not an Anthropic message: {_short(text, 120)}",
                     "the Anthropic endpoint is broken")
    return f"message with {blocks}, stop_reason {msg.get('stop_reason')}"


def check_image(s: Smoke, multimodal: bool = False, image_limit: int | None = None,
                **_) -> str:
    if not multimodal:
        return "skip: the model is text-only"
    question = {"type": "text", "text": "What is in this image? One short sentence."}
    picture = {"type": "image_url", "image_url": {"url": image_url()}}
    try:
        choice = s.chat([{"role": "user", "content": [question, picture]}]).choices[0]
    except openai.APIStatusError as exc:
        raise Failed(f"one image refused ({exc.status_code}: {_short(exc.message, 120)})",
                     "the engine does not serve the vision encoder: a text-only checkpoint, "
                     "or images disabled by a limit of 0") from None
    if not _answer(choice.message.content):
        cut = _truncated(choice, ANSWER_TOKENS)
        raise Failed(*(cut.args if cut else (
            f"no answer to the image (finish {choice.finish_reason})",
            "check the engine log for the image request")))
    detail = f"one image answered {_short(_answer(choice.message.content), 40)}"
    if not image_limit:
        return detail + "; no per-prompt limit to check"
    flag = IMAGE_LIMIT_FLAG[s.engine]
    n = image_limit + 1
    try:
        s.chat([{"role": "user", "content": [question] + [picture] * n}], max_tokens=64)
    except openai.APIStatusError as exc:
        if 400 <= exc.status_code < 500:
            return detail + f"; {n} images refused ({exc.status_code})"
        raise
    which = "second" if n == 2 else f"image #{n}"
    raise Failed(f"{which} image accepted: set {flag}",
                 f"set {flag} '{{\"image\":{image_limit}}}' on the engine")


def check_clear_thinking(s: Smoke, answers: bool = True, **_) -> str:
    if not answers:
        return RANDOM
    status, _text = s.http("GET", "/_lab/last_prompt")
    if status in (404, 405):  # no such route (a router answers 405)
        return "skip: not checkable on a real engine (no /_lab/last_prompt)"
    first = s.chat(READY).choices[0].message
    earlier = _reasoning(first)
    if not earlier:
        raise Failed("turn 1 returned no reasoning to carry",
                     f"is {REASONING_FLAG[s.engine]} set?")
    history = READY + [{"role": "assistant", "content": first.content or "READY",
                        "reasoning_content": earlier},
                       {"role": "user", "content": "And again?"}]
    s.chat(history, template={"clear_thinking": True})
    status, text = s.http("GET", "/_lab/last_prompt")
    if status != 200:
        raise Failed(f"/_lab/last_prompt answered {status}", "lab stand-in problem")
    if earlier in json.loads(text).get("prompt", ""):
        raise Failed("turn 2 with clear_thinking: true still carries turn 1's reasoning",
                     "the chat template ignores clear_thinking: override --chat-template?")
    return "turn 2 prompt without turn 1's reasoning"


CHECKS = {"models": check_models, "key": check_key, "ready": check_ready, "stream": check_stream,
          "completions": check_completions, "reasoning": check_reasoning,
          "tool_call": check_tool_call, "json_schema": check_json_schema,
          "messages": check_messages, "image": check_image,
          "clear_thinking": check_clear_thinking}


def _run_one(name: str, fn, s: Smoke, opts: dict) -> Check:
    try:
        detail = fn(s, **opts)
    except Failed as exc:
        return Check(name, False, exc.args[0], exc.args[1])
    except openai.APITimeoutError:
        return Check(name, False, f"no answer within {s.timeout:g}s",
                     "engine overloaded or stuck: check its log")
    except openai.APIConnectionError as exc:
        return Check(name, False, f"cannot connect to {s.v1} ({exc.__cause__ or exc})",
                     _unreachable(exc))
    except openai.AuthenticationError:
        return Check(name, False, "401 unauthorized", "wrong or missing API key")
    except openai.NotFoundError as exc:
        return Check(name, False, f"404: {_short(exc.message, 120)}",
                     "wrong model name or URL (--served-model-name, /v1 path)")
    except openai.APIStatusError as exc:
        return Check(name, False, f"HTTP {exc.status_code}: {_short(exc.message, 120)}",
                     "the engine refused the request: check its log")
    except (OSError, ValueError) as exc:  # urllib: refused, timeout, bad JSON
        return Check(name, False, f"{type(exc).__name__}: {exc}", _unreachable(exc))
    if detail.startswith("skip: "):
        return Check(name, True, detail[6:], skipped=True)
    return Check(name, True, detail)


# What a router answers for a while after its workers came back: sglang-router keeps a
# worker's circuit open for --cb-timeout-duration-secs (default 60) after failures; a
# router whose health check has not yet seen a restarted worker answers 502/503 too.
SETTLING = (502, 503, 504)


def settle(s: Smoke, seconds: float, say=print) -> int | None:
    """Send a one-token generation until the endpoint stops answering "not yet" (connection
    refused, 502/503/504), for at most `seconds`; returns the last status (None: no
    answer). Whatever the status then, the checks run and say what they find."""
    body = {"model": s.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Reply with exactly: READY"}]}
    deadline, told, status = time.monotonic() + seconds, 0.0, None
    while True:
        try:
            status = s.http("POST", "/v1/chat/completions", body)[0]
        except (OSError, ValueError):
            status = None
        left = deadline - time.monotonic()
        if (status is not None and status not in SETTLING) or left <= 0:
            return status
        if time.monotonic() - told >= 10:
            told = time.monotonic()
            say(f"smoke: {s.v1} answers {status or 'nothing'} (a router still settling); "
                f"asking again for up to {left:.0f}s", file=sys.stderr)
        time.sleep(min(2.0, max(left, 0)))


def run_smoke(base_url: str, model: str, engine: str, *, api_key: str | None = None,
              multimodal: bool = False, image_limit: int | None = None,
              reasoning_parser: bool = True, tool_parser: bool = True, timeout: float = 60,
              only: list[str] | None = None, ready_max_tokens: int = 64,
              ready_effort: str | None = "low", anthropic: bool | None = None,
              settle_s: float = 0, ca_file: str | None = None,
              answers: bool = True) -> list[Check]:
    """Run the checks (all, or `only` these) against base_url (with or without /v1).
    `anthropic`: the endpoint serves /v1/messages (default: SGLang servers do);
    `settle_s`: first wait up to this long for a router that answers "not yet";
    `answers`: False for a model of random weights (the checks that read an answer skip)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    s = Smoke(base_url, model, engine, api_key, timeout, ca_file)
    s.anthropic = engine == "sglang" if anthropic is None else anthropic
    opts = dict(multimodal=multimodal, image_limit=image_limit,
                reasoning_parser=reasoning_parser, tool_parser=tool_parser,
                ready_max_tokens=ready_max_tokens, ready_effort=ready_effort, answers=answers)
    names = list(only) if only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}: choose from {list(CHECKS)}")
    if settle_s > 0:
        settle(s, settle_s)
    checks: list[Check] = []
    for name in names:
        if checks and "cannot connect" in checks[0].detail:
            checks.append(Check(name, False, "not run: endpoint unreachable",
                                checks[0].cause))
            continue
        check = _run_one(name, CHECKS[name], s, opts)
        if api_key:
            check.detail = check.detail.replace(api_key, "***")
        checks.append(check)
    return checks


def options_from_plan(plan: dict) -> dict:
    """run_smoke kwargs for a `fab plan --format json` object (expects model.modalities;
    GLM-5.3 targets all reason and call tools; 002 promises one image per prompt). The
    engine is the one whose API the target's engine speaks (plan `speaks`)."""
    model = plan["model"]
    multimodal = "image" in (model.get("modalities") or [])
    routed = any(p["role"] == "router" for p in plan.get("processes", []))
    return {"base_url": plan["endpoint"], "model": model["served_name"],
            "engine": plan.get("speaks") or plan["engine"], "multimodal": multimodal,
            "image_limit": 1 if multimodal else None,
            "anthropic": plan["engine"] == "sglang" and not routed,
            "answers": not model.get("random_weights")}


def render_table(checks: list[Check]) -> str:
    width = max([len(c.name) for c in checks] + [5])
    lines = [f"{'CHECK':<{width}}  RESULT  DETAIL"]
    for c in checks:
        detail = c.detail + (f" -- likely cause: {c.cause}" if not c.ok and c.cause else "")
        lines.append(f"{c.name:<{width}}  {c.status:<6}  {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufleet.smoke", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--plan", help="a `fab plan --format json` file ('-' = stdin): takes the "
                   "endpoint, model, engine and image options from it")
    p.add_argument("--url", action="append", help="the router or worker URL (…/v1); repeat "
                   "it for replicas: every URL is checked, all at once")
    p.add_argument("--model", help="the served model name")
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--api-key-file", help="file holding the API key (never printed)")
    p.add_argument("--ca-file", help="the CA an https endpoint's certificate is verified "
                   "with (PEM; default: the system's trust store)")
    p.add_argument("--multimodal", action="store_true", help="the model takes images")
    p.add_argument("--image-limit", type=int, help="images per prompt the engine allows")
    p.add_argument("--no-reasoning-parser", action="store_true")
    p.add_argument("--no-tool-parser", action="store_true")
    p.add_argument("--random-weights", action="store_true", help="the model has random "
                   "weights: skip the checks that read its answers")
    p.add_argument("--timeout", type=float, default=60, help="seconds per request")
    p.add_argument("--settle", type=float, default=90, help="seconds to wait first while the "
                   "endpoint answers 502/503/504 or refuses connections (a router that has "
                   "not yet taken back a restarted worker; sglang-router's circuit breaker "
                   "waits 60 s); 0: check at once")
    p.add_argument("--only", action="append", choices=list(CHECKS), help="run these checks")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = p.parse_args(argv)
    if args.plan:
        with (sys.stdin if args.plan == "-" else open(args.plan)) as fh:
            opts = options_from_plan(json.load(fh))
        args.url = args.url or [opts["base_url"]]
        args.model = args.model or opts["model"]
        args.engine = args.engine or opts["engine"]
        args.multimodal = args.multimodal or opts["multimodal"]
        args.image_limit = args.image_limit or opts["image_limit"]
        args.random_weights = args.random_weights or not opts["answers"]
        anthropic = opts["anthropic"]
    else:
        anthropic = None
    missing = [f"--{n}" for n in ("url", "model", "engine") if not getattr(args, n)]
    if missing:
        p.error(f"{', '.join(missing)} required (or --plan)")
    key = None
    if args.api_key_file:
        try:
            with open(args.api_key_file) as fh:
                key = fh.read().strip() or None
        except OSError as exc:
            p.error(f"--api-key-file: {exc.strerror}: {args.api_key_file}")

    def one(url: str) -> list[Check]:
        return run_smoke(url, args.model, args.engine, api_key=key,
                         multimodal=args.multimodal, image_limit=args.image_limit,
                         reasoning_parser=not args.no_reasoning_parser,
                         tool_parser=not args.no_tool_parser, timeout=args.timeout,
                         only=args.only, anthropic=anthropic, settle_s=args.settle,
                         ca_file=args.ca_file, answers=not args.random_weights)

    with concurrent.futures.ThreadPoolExecutor(min(len(args.url), 16)) as pool:
        results = dict(zip(args.url, pool.map(one, args.url), strict=True))
    many = len(results) > 1
    if args.json:
        out = [{"url": url, "ok": all(c.ok for c in checks),
                "checks": [{**asdict(c), "status": c.status} for c in checks]}
               for url, checks in results.items()]
        ok = all(e["ok"] for e in out)
        print(json.dumps({"ok": ok, "endpoints": out} if many else
                         {"ok": ok, "checks": out[0]["checks"]}, indent=2))
    else:
        print("\n\n".join((f"{url}\n" if many else "") + render_table(checks)
                          for url, checks in results.items()))
    failed = 0
    for url, checks in results.items():
        for c in checks:
            if not c.ok:
                failed += 1
                print(f"smoke: {url + ': ' if many else ''}{c.name} failed: {c.detail} -- "
                      f"likely cause: {c.cause}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

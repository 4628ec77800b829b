"""The simulated model: a GLM-style chat template and deterministic generations.

The "model" reasons inside <think>...</think> (the template opens <think>), then answers.
Output is a list of (kind, text) tokens: kind is reason, end_think, answer or tool. The
server turns them into API fields the way the configured parsers would.
"""

from __future__ import annotations

import base64
import binascii
import json
import re

from .settings import DATA

_TOKEN = re.compile(r"\s*\S+")


class RequestError(Exception):
    """A 400-style error; args: (message, status)."""


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text or "")


def count(text: str) -> int:
    return len(tokens(text))


# --- messages ------------------------------------------------------------------------
def text_of(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        if part.get("type") == "text":
            parts.append(part.get("text", ""))
        elif part.get("type") in ("image_url", "image"):
            parts.append("<|begin_of_image|><|image|><|end_of_image|>")
    return "".join(parts)


def images_of(messages: list[dict]) -> list[str]:
    urls = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    url = part.get("image_url")
                    urls.append(url.get("url", "") if isinstance(url, dict) else str(url))
    return urls


def check_image(url: str) -> None:
    if not url.startswith("data:"):
        return
    head, _, data = url.partition(",")
    if ";base64" not in head or not data:
        raise RequestError("Invalid image data URL: expected data:<mime>;base64,<data>", 400)
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"Failed to load image: invalid base64 data ({exc})", 400) from exc


def effort_of(kwargs: dict) -> str:
    effort = kwargs.get("reasoning_effort")
    return effort if effort in ("low", "high", "max") else "max"


def render(messages: list[dict], tools: list | None, kwargs: dict) -> str:
    """The prompt as the GLM-5.3 chat template would render it (simplified)."""
    out = ["[gMASK]<sop>"]
    if tools:
        listing = "\n".join(json.dumps(t.get("function", t), sort_keys=True) for t in tools)
        out.append(f"<|system|>\n# Tools\n<tools>\n{listing}\n</tools>")
    out.append("<|system|>\n" + DATA["reasoning_effort_line"][effort_of(kwargs)])
    clear = bool(kwargs.get("clear_thinking", False))
    for msg in messages:
        role, text = msg.get("role"), text_of(msg.get("content"))
        if role in ("system", "developer"):
            out.append(f"<|system|>\n{text}")
        elif role == "user":
            out.append(f"<|user|>\n{text}")
        elif role == "assistant":
            reasoning = "" if clear else (msg.get("reasoning_content") or msg.get("reasoning")
                                          or "")
            calls = "".join(tool_markup(c["function"]["name"], _args(c["function"]))
                            for c in msg.get("tool_calls") or [])
            out.append(f"<|assistant|>\n<think>{reasoning}</think>\n{text}{calls}")
        elif role == "tool":
            out.append(f"<|observation|>\n<tool_response>{text}</tool_response>")
    thinking = kwargs.get("enable_thinking", True) is not False
    out.append("<|assistant|>\n<think>" if thinking else "<|assistant|>\n<think></think>\n")
    return "\n".join(out)


def _args(function: dict) -> dict:
    args = function.get("arguments") or "{}"
    try:
        return json.loads(args) if isinstance(args, str) else dict(args)
    except ValueError:
        return {}


def tool_markup(name: str, args: dict) -> str:
    """A GLM-4.7 style call (what the glm47 parser reads and glm45 does not)."""
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>"
                    f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>"
                    for k, v in args.items())
    return f"<tool_call>{name}{pairs}</tool_call>"


_CALL = re.compile(r"<tool_call>([^<]+)((?:<arg_key>.*?</arg_key><arg_value>.*?</arg_value>)*)"
                   r"</tool_call>", re.S)
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key><arg_value>(.*?)</arg_value>", re.S)


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(text before the first call, [(name, args)]) like the glm47 parser."""
    calls = []
    for m in _CALL.finditer(text):
        args = {}
        for key, value in _PAIR.findall(m.group(2)):
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
        calls.append((m.group(1).strip(), args))
    first = _CALL.search(text)
    return (text[: first.start()] if first else text), calls


# --- generation ----------------------------------------------------------------------
def sample(schema: dict, name: str = "value", hint: str = ""):
    """A value valid for a (simple) JSON schema, filling required fields."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        keys = schema.get("required") or list(props)
        return {k: sample(props.get(k, {"type": "string"}), k, hint) for k in keys}
    if kind == "array":
        return [sample(schema.get("items") or {"type": "string"}, name, hint)]
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return hint if hint and name in ("city", "location", "place") else f"example {name}"


def _place(text: str) -> str:
    m = re.search(r"\b(?:in|for|at)\s+([A-Z][\w-]+)", text)
    return m.group(1) if m else "Paris"


def _last_user(messages: list[dict]) -> str:
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return text_of(msg.get("content"))
    return ""


def reasoning_text(question: str, effort: str) -> str:
    words = [f"The user asks: {' '.join(question.split()[:12])}"]
    steps = DATA["reasoning_steps"]
    i = 0
    while len(" ".join(words).split()) < DATA["reasoning_words"][effort]:
        words.append(steps[i % len(steps)])
        i += 1
    return " ".join(" ".join(words).split()[: DATA["reasoning_words"][effort]])


def chat_output(body: dict) -> list[tuple[str, str]]:
    """The tokens the model emits for a chat request (after the opened <think>)."""
    messages = body.get("messages") or []
    kwargs = body.get("chat_template_kwargs") or {}
    question = _last_user(messages)
    out: list[tuple[str, str]] = []
    if kwargs.get("enable_thinking", True) is not False:
        out += [("reason", t) for t in tokens(reasoning_text(question, effort_of(kwargs)))]
        out.append(("end_think", "</think>"))
    tools = [t for t in body.get("tools") or [] if t.get("type", "function") == "function"]
    choice = body.get("tool_choice", "auto" if tools else "none")
    last = messages[-1] if messages else {}
    if tools and choice != "none" and last.get("role") != "tool":
        tool = tools[0]["function"]
        if isinstance(choice, dict):
            wanted = (choice.get("function") or {}).get("name")
            tool = next((t["function"] for t in tools if t["function"]["name"] == wanted), tool)
        args = sample(tool.get("parameters") or {"type": "object"}, tool["name"],
                      _place(question))
        return out + [("tool", t) for t in tokens(tool_markup(tool["name"], args))]
    return out + [("answer", t) for t in tokens(answer(body, question, last))]


def answer(body: dict, question: str, last: dict) -> str:
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") or {"type": "object"}
        return json.dumps(sample(schema, hint=_place(question)))
    if fmt.get("type") == "json_object":
        return json.dumps({"answer": DATA["generic_answer"]})
    if last.get("role") == "tool":
        return DATA["tool_answer"].format(result=text_of(last.get("content")))
    m = re.search(r"[Rr]eply with exactly:?\s*(.+)", question)
    if m:
        return m.group(1).strip().strip("\"'")
    if images_of(body.get("messages") or []):
        return DATA["image_answer"]
    return DATA["generic_answer"]


def completion_output(prompt: str) -> list[tuple[str, str]]:
    m = re.search(r"[Rr]eply with exactly:?\s*(\S+)", prompt)
    text = " " + m.group(1) if m else DATA["completion_text"]
    return [("answer", t) for t in tokens(text)]

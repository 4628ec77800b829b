"""Anthropic Messages API (/v1/messages) mapped onto the chat path."""

from __future__ import annotations

import json
import uuid


def to_chat(body: dict) -> dict:
    messages = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else "".join(
            b.get("text", "") for b in system)
        messages.append({"role": "system", "content": text})
    for msg in body.get("messages") or []:
        content = msg.get("content")
        if isinstance(content, str):
            messages.append({"role": msg["role"], "content": content})
            continue
        parts, calls = [], []
        for block in content or []:
            kind = block.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "image":
                src = block.get("source") or {}
                url = f"data:{src.get('media_type')};base64,{src.get('data')}"
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input"))}})
            elif kind == "tool_result":
                result = block.get("content")
                if not isinstance(result, str):
                    result = "".join(b.get("text", "") for b in result or [])
                messages.append({"role": "tool", "content": result})
        if parts or calls:
            messages.append({"role": msg["role"], "content": parts,
                             **({"tool_calls": calls} if calls else {})})
    tools = [{"type": "function", "function": {"name": t["name"],
                                               "description": t.get("description", ""),
                                               "parameters": t.get("input_schema") or {}}}
             for t in body.get("tools") or []]
    chat = {"messages": messages, "max_tokens": body.get("max_tokens"),
            "chat_template_kwargs": body.get("chat_template_kwargs") or {}}
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = "auto"
    return chat


def to_message(out: dict, model: str, prompt_tokens: int) -> dict:
    blocks = []
    if out["reasoning"]:
        blocks.append({"type": "thinking", "thinking": out["reasoning"], "signature": ""})
    if out["content"]:
        blocks.append({"type": "text", "text": out["content"]})
    for call in out["tool_calls"]:
        blocks.append({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24],
                       "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    stop = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}[out["finish"]]
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
            "model": model, "content": blocks, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": out["generated"]}}


def stream_events(msg: dict):
    """The Messages streaming event sequence for a finished message."""

    def event(name: str, data: dict) -> bytes:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()

    head = {**msg, "content": [], "stop_reason": None,
            "usage": {**msg["usage"], "output_tokens": 0}}
    yield event("message_start", {"message": head})
    for i, block in enumerate(msg["content"]):
        kind = block["type"]
        empty = {"thinking": {"type": "thinking", "thinking": ""},
                 "text": {"type": "text", "text": ""},
                 "tool_use": {**block, "input": {}}}[kind]
        yield event("content_block_start", {"index": i, "content_block": empty})
        delta = {"thinking": {"type": "thinking_delta", "thinking": block.get("thinking")},
                 "text": {"type": "text_delta", "text": block.get("text")},
                 "tool_use": {"type": "input_json_delta",
                              "partial_json": json.dumps(block.get("input"))}}[kind]
        yield event("content_block_delta", {"index": i, "delta": delta})
        yield event("content_block_stop", {"index": i})
    yield event("message_delta", {"delta": {"stop_reason": msg["stop_reason"],
                                            "stop_sequence": None},
                                  "usage": {"output_tokens": msg["usage"]["output_tokens"]}})
    yield event("message_stop", {})

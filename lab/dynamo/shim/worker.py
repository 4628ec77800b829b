"""The lab's Dynamo worker: Dynamo's own backend SDK serving the stand-in model's answers.

``dynamo.common.backend`` (the unified Python backend of ai-dynamo 1.6.1) registers the
model with the checkpoint's tokenizer, chat template and the ``--dyn-*-parser`` names,
serves ``generate`` over the real request plane, publishes KV events for the KV router,
and registers prefill workers as such, so the frontend's prefill router sends each request
to a prefill worker and then to a decode worker, as with vLLM.

``generate`` receives the frontend's token ids, decodes them with the checkpoint's
tokenizer (``bpe.py``), reads the conversation back from the GLM chat template, runs the
stand-in model (``_standin/model.py``, the same code as the vLLM/SGLang stand-ins) and
streams its answer as token ids. The frontend then detokenizes and applies the real
glm45/glm47 parsers to ``<think>``/``</think>``/``<tool_call>`` text.

One stand-in token (a whitespace-delimited word) is one chunk, and ``max_tokens`` counts
these, as in the other stand-ins: the lab checkpoint's tokenizer has almost no merges, so
a word is several ids. GLM markers the tokenizer declares ``special`` are sent as their
plain characters, since the frontend's detokenizer drops special tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import uuid
from collections import OrderedDict
from typing import Any

from dynamo.common.backend.engine import EngineConfig, LLMEngine, LlmRegistration
from dynamo.common.backend.health_check import build_health_check_payload, is_probe
from dynamo.common.backend.publisher import PushSource
from dynamo.common.backend.run import run
from dynamo.common.backend.worker import WorkerConfig
from dynamo.common.constants import DisaggregationMode
from dynamo.llm.exceptions import InvalidArgument

from ._standin import model as standin
from .bpe import Tokenizer

logger = logging.getLogger(__name__)

ROLES = {"<|system|>": "system", "<|user|>": "user", "<|assistant|>": "assistant",
         "<|observation|>": "tool"}  # fmt: skip
_TURN = re.compile("(" + "|".join(re.escape(r) for r in ROLES) + ")\n?")
_TOOLS = re.compile(r"<tools>\n(.*?)</tools>", re.S)
_THINK = re.compile(r"^<think>(.*?)</think>\n?", re.S)
DECODE_S = 0.01  # seconds per stand-in token at speedup 1 (before MTP)
PREFILL_S = 2e-5  # seconds per prompt token at speedup 1
HANDSHAKE = b"gpufleet-lab-nixl\n"


def parse_prompt(text: str) -> dict | None:
    """The chat request a GLM-templated prompt came from, or None for a plain prompt."""
    if not any(r in text for r in ROLES):
        return None
    parts = _TURN.split(text)
    messages: list[dict] = []
    for marker, body in zip(parts[1::2], parts[2::2], strict=False):
        role = ROLES[marker]
        msg: dict[str, Any] = {"role": role}
        if role == "assistant":
            m = _THINK.match(body)
            if m:
                msg["reasoning_content"], body = m.group(1), body[m.end() :]
        elif role == "tool":
            body = body.removeprefix("<tool_response>").removesuffix("</tool_response>")
        msg["content"] = body
        messages.append(msg)
    tools = []
    m = _TOOLS.search(text)
    for line in m.group(1).splitlines() if m else []:
        try:
            tools.append(json.loads(line))
        except ValueError:
            continue
    last = messages[-1] if messages else {}
    thinking = True
    if last.get("role") == "assistant":  # the generation prompt, not a turn
        messages.pop()
        thinking = "reasoning_content" not in last  # "<think></think>" turns thinking off
    return {"messages": messages, "tools": tools, "enable_thinking": thinking}


def chat_body(chat: dict, request: dict) -> dict:
    """The OpenAI-style body the stand-in model reads, from the prompt and the request."""
    extra = request.get("extra_args") or {}
    kwargs = dict(extra.get("chat_template_kwargs") or {})
    kwargs.update((extra.get("reasoning_parser_kwargs") or {}).get("chat_template_kwargs") or {})
    kwargs["enable_thinking"] = chat["enable_thinking"]
    body: dict[str, Any] = {"messages": chat["messages"], "chat_template_kwargs": kwargs}
    tools = [t if "function" in t else {"type": "function", "function": t}
             for t in chat["tools"]]  # fmt: skip
    if tools:
        body["tools"] = tools
    users = [m for m in chat["messages"] if m["role"] == "user"]
    if request.get("multi_modal_data") and users:  # the template leaves images out
        image = {"type": "image_url", "image_url": {"url": "data:,"}}
        users[-1]["content"] = [{"type": "text", "text": users[-1]["content"]}, image]
    guided = (request.get("sampling_options") or {}).get("guided_decoding") or {}
    schema = guided.get("json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            schema = None
    if isinstance(schema, dict):
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    return body


def _signed64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big", signed=True)


class LabEngine(LLMEngine):
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.mode = DisaggregationMode(cfg["mode"])
        self.tokenizer = Tokenizer.from_dir(cfg["model_path"])
        self.block = int(cfg.get("block_size") or 16)
        self.capacity = int(cfg.get("kv_blocks") or 16384)
        self.stored: OrderedDict[int, None] = OrderedDict()
        self.publisher = None
        self.server: asyncio.AbstractServer | None = None
        speedup = float(cfg.get("speedup") or 1) or 1.0
        self.token_delay = DECODE_S / speedup / float(cfg.get("decode_speedup") or 1)
        self.prefill_delay = PREFILL_S / speedup
        self.engine_id = uuid.uuid4().hex

    @classmethod
    async def from_args(cls, argv=None):
        raise NotImplementedError("started by dynamo.vllm (lab.py), which checks the argv")

    def worker_config(self) -> WorkerConfig:
        c = self.cfg
        return WorkerConfig(
            namespace=c["namespace"], component=c["component"], endpoint=c["endpoint"],
            model_name=c["model_path"], served_model_name=c["served"],
            discovery_backend=c["discovery_backend"], request_plane=c["request_plane"],
            response_plane=c["response_plane"], event_plane=c["event_plane"],
            tool_call_parser=c.get("tool_call_parser"),
            reasoning_parser=c.get("reasoning_parser"),
            disaggregation_mode=self.mode,
        )  # fmt: skip

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        side = self.cfg.get("side_channel")
        if self.mode == DisaggregationMode.PREFILL and side:
            # NIXL's side channel: decode workers connect here before reading the KV.
            # vLLM binds its side channel to VLLM_NIXL_SIDE_CHANNEL_HOST, so "localhost"
            # (its default) is unreachable from other hosts.
            self.server = await asyncio.start_server(self._handshake, side["host"], side["port"])
        c = self.cfg
        return EngineConfig(
            model=c["model_path"], served_model_name=c["served"],
            llm=LlmRegistration(
                context_length=c.get("max_model_len"), kv_cache_block_size=self.block,
                total_kv_blocks=self.capacity, max_num_seqs=c.get("max_num_seqs"),
                max_num_batched_tokens=c.get("max_num_batched_tokens"),
            ),
        )  # fmt: skip

    async def _handshake(self, reader, writer) -> None:
        try:
            if await reader.readline() == HANDSHAKE:
                logger.info(
                    "NIXL side channel: handshake from %s", writer.get_extra_info("peername")
                )
                writer.write(json.dumps({"engine_id": self.engine_id}).encode() + b"\n")
                await writer.drain()
        finally:
            writer.close()

    async def kv_event_sources(self):
        return [PushSource(on_ready=self._kv_ready, dp_rank=0)]

    def _kv_ready(self, publisher) -> None:
        self.publisher = publisher

    async def health_check_payload(self):
        bos = self.tokenizer.token_id("[gMASK]") or 0
        return build_health_check_payload(bos_token_id=bos)

    def _cache(self, ids: list[int]) -> None:
        """Publish the prompt's full blocks as stored (and the evicted ones as removed)."""
        if self.publisher is None:
            return
        hashes, parent = [], b""
        n = len(ids) // self.block
        for i in range(n):
            chunk = ids[i * self.block : (i + 1) * self.block]
            h = _signed64(parent + json.dumps(chunk).encode())
            hashes.append(h)
            parent = h.to_bytes(8, "big", signed=True)
        first = next((i for i, h in enumerate(hashes) if h not in self.stored), n)
        for h in hashes[:first]:
            self.stored.move_to_end(h)
        if first == n:
            return
        try:
            self.publisher.publish_stored(
                token_ids=ids[first * self.block : n * self.block],
                num_block_tokens=[self.block] * (n - first),
                block_hashes=hashes[first:],
                parent_hash=hashes[first - 1] if first else None,
            )
            self.stored.update((h, None) for h in hashes[first:])
            evicted = []
            while len(self.stored) > self.capacity:
                evicted.append(self.stored.popitem(last=False)[0])
            if evicted:
                self.publisher.publish_removed(evicted)
        except Exception:  # KV events are advisory; never fail a request on them
            logger.exception("KV event publish failed")

    def answer(self, request: dict) -> list[str]:
        """The stand-in model's output for this request: one string per token."""
        prompt = self.tokenizer.decode(request.get("token_ids") or [])
        chat = parse_prompt(prompt)
        if chat is None:
            return [text for _, text in standin.completion_output(prompt)]
        return [text for _, text in standin.chat_output(chat_body(chat, request))]

    def encode_token(self, text: str) -> list[int]:
        """Ids for one stand-in token; GLM markers stay visible to the frontend's parsers."""
        ids = []
        for piece in re.split(r"(<[^<>\s]+>)", text):
            marker = self.tokenizer.token_id(piece) if piece.startswith("<") else None
            if marker is not None and marker not in self.tokenizer.special:
                ids.append(marker)
            elif piece:
                ids += self.tokenizer.encode(piece, specials=False)
        return ids

    async def _connect_prefill(self, params: dict) -> None:
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port:
            return
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            writer.write(HANDSHAKE)
            await writer.drain()
            reply = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
        except (TimeoutError, OSError) as exc:
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            raise RuntimeError(
                f"NIXL handshake with {host}:{port} failed: bootstrap connection failed: {reason}"
            ) from None
        if json.loads(reply or b"{}").get("engine_id") != params.get("remote_engine_id"):
            raise RuntimeError(f"NIXL handshake with {host}:{port}: a different engine answered")

    def _check_images(self, request: dict) -> None:
        """vLLM's --limit-mm-per-prompt: more images than allowed is a bad request."""
        limit = (self.cfg.get("limit_mm_per_prompt") or {}).get("image")
        data = request.get("multi_modal_data") or {}
        images = sum(len(v) if isinstance(v, list) else 1
                     for k, v in data.items() if "image" in k)  # fmt: skip
        if limit is not None and images > int(limit):
            raise InvalidArgument(
                f"At most {limit} image(s) may be provided in one prompt (got {images}); "
                "set --limit-mm-per-prompt to allow more"
            )

    async def generate(self, request, context):
        ids = list(request.get("token_ids") or [])
        usage = {"prompt_tokens": len(ids)}
        if is_probe(request):
            yield {"token_ids": ids[:1] or [0], "index": 0, "finish_reason": "stop",
                   "completion_usage": {**usage, "completion_tokens": 1,
                                        "total_tokens": len(ids) + 1}}  # fmt: skip
            return
        self._check_images(request)
        if self.mode == DisaggregationMode.DECODE:
            prefill = request.get("prefill_result")
            if prefill is None:
                raise ValueError(
                    "decode worker received a request without prefill_result: "
                    "is a prefill worker registered?"
                )
            await self._connect_prefill(prefill.get("disaggregated_params") or {})
        else:
            self._cache(ids)
            await asyncio.sleep(self.prefill_delay * len(ids))
        tokens = self.answer(request) or [""]
        if self.mode == DisaggregationMode.PREFILL:
            side = self.cfg.get("side_channel") or {}
            params = {
                "remote_engine_id": self.engine_id,
                "remote_host": side.get("host"),
                "remote_port": side.get("port"),
                "num_prompt_tokens": len(ids),
            }
            yield {"token_ids": self.encode_token(tokens[0]), "index": 0,
                   "finish_reason": "length", "disaggregated_params": params,
                   "completion_usage": {**usage, "completion_tokens": 1,
                                        "total_tokens": len(ids) + 1}}  # fmt: skip
            return
        stop = request.get("stop_conditions") or {}
        limit = stop.get("max_tokens") or len(tokens)
        sent = tokens[:limit]
        for i, text in enumerate(sent):
            if context.is_stopped():
                return
            chunk: dict[str, Any] = {"token_ids": self.encode_token(text), "index": 0}
            if i == len(sent) - 1:
                chunk["finish_reason"] = "length" if len(tokens) > limit else "stop"
                chunk["completion_usage"] = {**usage, "completion_tokens": len(sent),
                                             "total_tokens": len(ids) + len(sent)}  # fmt: skip
            yield chunk
            await asyncio.sleep(self.token_delay)

    async def cleanup(self) -> None:
        if self.server is not None:
            self.server.close()


def serve(cfg: dict) -> None:
    engine = LabEngine(cfg)

    async def factory(argv=None):
        return engine, engine.worker_config()

    run(LabEngine, engine_factory=factory)

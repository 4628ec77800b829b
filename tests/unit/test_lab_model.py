"""The lab's real model (gpufleet-lab/GLM-5.3-Tiny): a checkpoint a real engine loads, made
by the lab mirror itself (no hub), downloaded by the real Hugging Face client as a real
checkpoint is. Its weights are random: a test proves the format, never an answer."""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import pytest
from huggingface_hub import snapshot_download
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpufleet_lab.hfmirror import MirrorServer

TINY = "gpufleet-lab/GLM-5.3-Tiny"


@pytest.fixture(scope="module")
def mirror():
    with MirrorServer(repos=[TINY], log_stream=io.StringIO()) as server:
        yield server


@pytest.fixture(scope="module")
def snapshot(mirror, tmp_path_factory):
    return snapshot_download(TINY, endpoint=mirror.url, token=False,
                             cache_dir=tmp_path_factory.mktemp("hf"))


def _bf16(raw: bytes) -> list[float]:
    return [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]


def test_the_client_downloads_every_file_the_engine_reads(snapshot):
    names = {p.name for p in Path(snapshot).iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    # one weights file, no index: what a small checkpoint ships
    assert "model.safetensors.index.json" not in names


def test_the_weights_hold_every_tensor_of_the_config_at_its_shape(snapshot):
    config = json.loads((Path(snapshot) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    data = (Path(snapshot) / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__")
    hidden, head = config["hidden_size"], config["head_dim"]
    # vLLM's CPU attention takes head sizes 32 and up (16 was refused at the first request)
    assert head == 64 and config["num_attention_heads"] * head == hidden
    expected = {"model.embed_tokens.weight": [config["vocab_size"], hidden],
                "lm_head.weight": [config["vocab_size"], hidden],
                "model.layers.1.self_attn.k_proj.weight":
                    [config["num_key_value_heads"] * head, hidden],
                "model.layers.1.mlp.down_proj.weight": [hidden, config["intermediate_size"]]}
    for name, shape in expected.items():
        assert header[name]["shape"] == shape and header[name]["dtype"] == "BF16", name
    assert len(header) == 3 + 9 * config["num_hidden_layers"]
    # the tensors tile the data with nothing left over
    spans = sorted(tuple(t["data_offsets"]) for t in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert 8 + n + spans[-1][1] == len(data)
    body = data[8 + n:]

    def values(name):
        start, end = header[name]["data_offsets"]
        return _bf16(body[start:end])

    assert set(values("model.norm.weight")) == {1.0}
    weights = values("model.layers.0.self_attn.q_proj.weight")
    assert all(math.isfinite(v) for v in weights)
    mean = sum(weights) / len(weights)
    std = math.sqrt(sum((v - mean) ** 2 for v in weights) / len(weights))
    assert abs(mean) < 0.002 and 0.018 < std < 0.022


def test_the_tokenizer_covers_the_vocabulary_and_the_template_is_glms(snapshot):
    root = Path(snapshot)
    config = json.loads((root / "config.json").read_text())
    tok = json.loads((root / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    assert ids == set(range(config["vocab_size"]))  # every logit has a token
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert [special[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")] == \
        config["eos_token_id"]
    template = json.loads((root / "tokenizer_config.json").read_text())["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(template).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt == "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think>"


def test_the_model_is_the_same_every_time_it_is_made(mirror):
    again = MirrorServer(repos=[TINY], log_stream=io.StringIO())
    try:
        ours, theirs = mirror.repos[TINY], again.repos[TINY]
        assert {p: f.sha256 for p, f in ours.files.items()} == \
            {p: f.sha256 for p, f in theirs.files.items()}
        assert ours.sha == theirs.sha
        assert 500_000 < ours.files["model.safetensors"].size < 2_000_000
    finally:
        again.stop()

"""Write a tiny model directory that Dynamo's frontend and mocker can load.

A byte-level BPE tokenizer with no merges (every byte is a token, so any text
round-trips), a chat template and a config.json in the canonical layout the mocker
reads without transformers (num_hidden_layers, num_attention_heads, hidden_size at
the top level). Dynamo 1.6.1's mocker answers with random token ids in [1000, 2000),
so ids up to VOCAB_SIZE are filled with pronounceable words: answers decode to text.
Stdlib only; no weights.

    python scripts/lab/dynamo/tiny_model.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<think>",
    "</think>",
]
VOCAB_SIZE = 2048
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "ta",
    "vo",
    "zi",
    "sa",
    "po",
    "de",
    "gu",
    "fe",
    "ha",
    "jo",
    "bi",
]
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (256 entries, in byte order)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tokenizer_json() -> dict:
    vocab = {ch: i for i, ch in enumerate(_byte_chars())}
    first = 256 + len(SPECIALS)
    for i in range(first, VOCAB_SIZE):
        n, word = i, ""
        while n:
            n, r = divmod(n, len(SYLLABLES))
            word += SYLLABLES[r]
        vocab["\u0120" + word] = i  # "\u0120" is the byte-level space
    added = [
        {
            "id": 256 + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIALS)
    ]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def write(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    eos = 256 + SPECIALS.index("<|endoftext|>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "bos_token_id": eos,
        "eos_token_id": eos,
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    files = {
        "config.json": config,
        "generation_config.json": {"eos_token_id": eos, "bos_token_id": eos},
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": tok_config,
        "special_tokens_map.json": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    }
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py DIR")
    print(write(Path(sys.argv[1])))

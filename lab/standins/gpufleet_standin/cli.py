"""The engines' own parser entry points, as the lab's stand-ins expose them.

A real engine builds an argparse parser (vLLM: ``make_arg_parser`` on a
``FlexibleArgumentParser``; SGLang: ``ServerArgs.add_cli_args``) and parses the command
line with it. The stand-ins offer the same calls at the same import paths (see the
shims), so a program that parses a command line with the installed engine's parser
(gpufleet/host/dry_parse.py) runs unchanged against them. What the parser accepts comes
from the one check the stand-ins have, the vendored ``engine_flags`` with the real
engines' flag tables; a refusal goes through argparse's own ``error()``: the usage line,
``PROG: error: MESSAGE`` in argparse's words on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata

from . import engine_flags
from .settings import DATA, flag_values


def argparse_words(problem: str) -> str:
    """engine_flags' wording of a problem, in argparse's words."""
    m = re.match(r"unknown flag (\S+)|unexpected argument '(.*)'", problem)
    if m:
        return f"unrecognized arguments: {m.group(1) or m.group(2)}"
    m = re.match(r"(\S+) '(.*)' is not one of (.*)", problem)
    if m:
        return f"argument {m.group(1)}: invalid choice: '{m.group(2)}' (choose from {m.group(3)})"
    m = re.match(r"(\S+) (needs .*)", problem)
    if m:
        return f"argument {m.group(1)}: expected one argument"
    return problem


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def arm(parser: argparse.ArgumentParser, engine: str) -> argparse.ArgumentParser:
    """Make ``parser`` parse as the engine's parser does (standin.json's engine key).

    Its parse_known_args (which parse_args calls) checks the arguments against the
    engine's table and returns a Namespace of the flags given (dest names as argparse
    makes them; vLLM's positional model as ``model_tag``).
    """
    spec = DATA["engines"][engine]
    program = spec["program"]
    prefix = program.split() if engine == "vllm" else ["python", "-m", program]

    try:  # the release installed: its own table (engine_flags.RELEASES)
        version = metadata.version(engine)
    except metadata.PackageNotFoundError:
        version = None

    def parse_known_args(args=None, namespace=None):
        args = sys.argv[1:] if args is None else [str(a) for a in args]
        problems = engine_flags.check(prefix + args, version)
        if problems:
            parser.error(argparse_words(problems[0].split(": ", 1)[-1]))
        namespace = argparse.Namespace() if namespace is None else namespace
        for flag, value in flag_values(program, args, spec["aliases"]).items():
            setattr(namespace, _dest(flag) if flag else "model_tag", value)
        return namespace, []

    parser.parse_known_args = parse_known_args
    if engine == "vllm":  # vLLM's make_arg_parser adds the model positional
        parser.add_argument("model_tag", nargs="?")
    if parser.usage is None:
        parser.usage = spec["usage"].split("usage: ", 1)[-1]
    return parser


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's parser class (vllm.utils.argparse_utils); the table check comes with
    ``make_arg_parser``, as vLLM's options do."""


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vLLM's ``make_arg_parser``: the options of ``vllm serve`` on ``parser``."""
    return arm(parser, "vllm")


class ServerArgs:
    """SGLang's ``ServerArgs``: only its command-line half (``add_cli_args``)."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        arm(parser, "sglang")

"""``dynamo.vllm.args`` in the lab: ``parse_args``, the worker's own argument parsing.

Upstream's ``parse_args(argv)`` parses Dynamo's worker options plus every vLLM engine
option; here the argv is checked with the same table check as ``python -m dynamo.vllm``
(``lab.py``): a refusal prints the usage and ``__main__.py: error: ...`` on stderr and
exits 2, as argparse does. Nothing is started and no GPU is looked at.
"""

from __future__ import annotations

import argparse
import sys

from .engine_flags import check
from .lab import _parser, _usage_error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    problems = check(["python", "-m", "dynamo.vllm", *argv])
    if problems:
        print(str(_usage_error(problems[0].split(": ", 1)[-1])), file=sys.stderr)
        raise SystemExit(2)
    args, _ = _parser().parse_known_args(argv)
    return args

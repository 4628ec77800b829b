"""vllm.entrypoints.launchers.cli_args (lab stand-in): ``make_arg_parser``, where vLLM
0.31 and 0.33 keep it; the options come from the vendored flag table."""

from vllm._standin.cli import make_arg_parser

__all__ = ["make_arg_parser"]

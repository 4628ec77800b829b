"""vllm.utils.argparse_utils (lab stand-in): vLLM's parser class."""

from vllm._standin.cli import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]

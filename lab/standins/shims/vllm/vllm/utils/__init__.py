"""vllm.utils (lab stand-in): only what argument parsing needs."""

from vllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]

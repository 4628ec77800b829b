"""`vllm` console script (lab stand-in)."""

import sys

from vllm import __version__
from vllm._standin.main import vllm_cli


def main():
    sys.exit(vllm_cli(sys.argv[1:], __version__))


if __name__ == "__main__":
    main()

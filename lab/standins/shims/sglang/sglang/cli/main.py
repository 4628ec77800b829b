"""`sglang` console script (lab stand-in)."""

import sys

from sglang import __version__
from sglang._standin.main import sglang_cli


def main():
    sys.exit(sglang_cli(sys.argv[1:], __version__))


if __name__ == "__main__":
    main()

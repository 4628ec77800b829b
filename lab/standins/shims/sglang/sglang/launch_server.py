"""`python -m sglang.launch_server` (lab stand-in)."""

import sys

from sglang import __version__
from sglang._standin.main import sglang_launch

if __name__ == "__main__":
    sys.exit(sglang_launch(sys.argv[1:], __version__))

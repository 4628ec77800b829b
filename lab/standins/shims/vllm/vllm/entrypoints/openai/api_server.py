"""`python -m vllm.entrypoints.openai.api_server` (lab stand-in)."""

import sys

from vllm import __version__
from vllm._standin.main import vllm_api_server

if __name__ == "__main__":
    sys.exit(vllm_api_server(sys.argv[1:], __version__))

"""sglang.srt.server_args (lab stand-in): ``ServerArgs.add_cli_args``; the options come
from the vendored flag table."""

from sglang._standin.cli import ServerArgs

__all__ = ["ServerArgs"]

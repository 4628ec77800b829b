"""gpufleet lab stand-in for vLLM: real command line and HTTP API, simulated engine."""

__version__ = "@VERSION@"

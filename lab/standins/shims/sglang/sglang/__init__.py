"""gpufleet lab stand-in for SGLang: real command line and HTTP API, simulated engine."""

__version__ = "@VERSION@"

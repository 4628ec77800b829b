"""gpufleet lab stand-in for FlashInfer: only the version is real."""

__version__ = "@VERSION@"

"""gpufleet lab stand-in for flashinfer-cubin: only the version is real."""

__version__ = "@VERSION@"

__version__ = "@VERSION@"

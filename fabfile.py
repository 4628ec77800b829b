"""Fabric looks for a module named `fabfile`; gpufleet's tasks live in tasks.py
(the layout in docs/architecture.md). Re-exporting the collection lets `fab` work from the
repository root with no flag or environment variable."""

from tasks import ns  # noqa: F401

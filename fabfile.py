"""Fabric looks for a module named `fabfile`; gpufleet's tasks live in tasks.py
(the layout DESIGN.md fixes). Re-exporting the collection lets `fab` work from the
repository root with no flag or environment variable."""

from tasks import ns  # noqa: F401

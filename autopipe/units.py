"""Compatibility alias: this module is now :mod:`autopipe.humanize` (it formats quantities;
``autopipe.profiler.units`` is the unit graph)."""

from autopipe.humanize import MAX_BYTES, format_bytes, format_seconds, parse_bytes

__all__ = ["MAX_BYTES", "format_bytes", "format_seconds", "parse_bytes"]

"""Integrations with other frameworks (t5x: decoding from inside T5X)."""

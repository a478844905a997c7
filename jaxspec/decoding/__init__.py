"""Decoders: the baseline (one token per step) and speculative decoding."""

"""jaxspec: exact speculative decoding for T5 encoder-decoders in JAX."""

from jaxspec.config import EOS_ID, PAD_ID, T5Config, get_config

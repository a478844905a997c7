"""Text corpora and vocabulary shipped with jaxspec (pure Python, no TensorFlow)."""

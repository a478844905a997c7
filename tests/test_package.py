"""Package-level properties: a TensorFlow-free decoding core, dtypes from config."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import get_config
from jaxspec.model import T5, init_params


def test_decoding_core_imports_without_tensorflow():
  code = ('import sys\n'
          'import jaxspec.model, jaxspec.sampling, jaxspec.decoding.baseline\n'
          'import jaxspec.decoding.speculative, jaxspec.decoding.drafters\n'
          'import jaxspec.checkpoints, jaxspec.checkpoints.t5x, jaxspec.measure.analysis\n'
          'bad = [m for m in ("tensorflow", "seqio", "torch", "t5x") if m in sys.modules]\n'
          'assert not bad, bad\n')
  subprocess.run([sys.executable, '-c', code], check=True)


# Each a jitted program: the dtypes are the traced ones, as when the calls run one
# operation at a time (which compiled ~250 small programs here).
@functools.partial(jax.jit, static_argnums=0)
def _encode_and_step(config, variables, encoder_tokens):
  """The encoder output, the decoder cache and the first decode step's logits."""
  model = T5(config)
  encoded = model.apply(variables, encoder_tokens, method=T5.encode)
  cache = model.apply(variables, encoded, encoder_tokens, 4, method=T5.init_cache)
  logits, _ = model.apply(variables, jnp.zeros((1, 1), jnp.int32), cache, method=T5.decode)
  return encoded, cache, logits


@functools.partial(jax.jit, static_argnums=0)
def _float32_forward(config, variables, encoder_tokens, decoder_tokens):
  """The logits of config's model in float32 on the variables cast to float32."""
  f32_config = config.replace(dtype='float32', param_dtype='float32')
  f32_variables = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), variables)
  return T5(f32_config).apply(f32_variables, encoder_tokens, decoder_tokens)


def test_compute_and_parameter_dtypes_come_from_config():
  config = get_config('test_tiny_1_1', dtype='bfloat16', param_dtype='bfloat16')
  variables = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(variables['params']))
  encoder_tokens = jnp.array([[5, 6, 1]])
  encoded, cache, logits = _encode_and_step(config, variables, encoder_tokens)
  assert encoded.dtype == jnp.bfloat16
  assert cache.layers[0].self_keys.dtype == jnp.bfloat16
  assert logits.dtype == jnp.float32  # Logits stay float32, as T5X.
  # The same weights in float32 give nearly the same logits.
  f32_logits = _float32_forward(config, variables, encoder_tokens,
                                jnp.zeros((1, 1), jnp.int32))
  np.testing.assert_allclose(logits, f32_logits, atol=0.1, rtol=0.05)

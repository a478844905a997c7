"""Layers and parameter tree against T5X's facts (docs/t5x-compat) and transformers."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import get_config
from jaxspec.model import abstract_params, layers

# Test vectors of t5x-compat.md: the smallest n = query_pos - key_pos in each log bucket.
UNIDIRECTIONAL_STARTS = [16, 19, 21, 24, 27, 31, 35, 40, 46, 52, 59, 67, 77, 87, 99, 113]
BIDIRECTIONAL_STARTS = [8, 12, 16, 23, 32, 46, 64, 91]


def bucket(distance, bidirectional):
  """Bucket of a key `distance` positions before the query (negative: after it)."""
  return int(layers.relative_position_bucket(-np.int32(distance), bidirectional))


def test_unidirectional_buckets_match_t5x_vectors():
  assert [bucket(n, False) for n in range(16)] == list(range(16))
  for b, start in enumerate(UNIDIRECTIONAL_STARTS, start=16):
    assert bucket(start, False) == b, start
    assert bucket(start - 1, False) == b - 1, start - 1
  assert bucket(10_000, False) == 31
  assert bucket(-5, False) == 0  # Keys after the query all fall in bucket 0.


@pytest.mark.parametrize('sign, offset', [(1, 0), (-1, 16)], ids=['before', 'after'])
def test_bidirectional_buckets_match_t5x_vectors(sign, offset):
  """Keys before the query use buckets 0..15, keys after it 16..31."""
  assert [bucket(sign * n, True) for n in range(1, 8)] == [offset + n for n in range(1, 8)]
  for b, start in enumerate(BIDIRECTIONAL_STARTS, start=8):
    assert bucket(sign * start, True) == offset + b, start
    assert bucket(sign * (start - 1), True) == offset + b - 1, start - 1
  assert bucket(sign * 10_000, True) == offset + 15
  assert bucket(0, True) == 0


@pytest.mark.parametrize('bidirectional', [True, False])
def test_buckets_match_transformers(bidirectional):
  import torch  # The test extra installs torch and transformers: never skip silently.
  from transformers.models.t5 import modeling_t5
  relative = np.arange(-300, 301, dtype=np.int32)
  expected = modeling_t5.T5Attention._relative_position_bucket(
      torch.tensor(relative), bidirectional=bidirectional, num_buckets=32, max_distance=128)
  np.testing.assert_array_equal(layers.relative_position_bucket(relative, bidirectional),
                                expected.numpy())


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_rms_norm_matches_numpy(dtype):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 16)).astype(np.float32) * 3.0  # [b, t, e]
  scale = rng.normal(size=(16,)).astype(np.float32)
  config = get_config('test_tiny_1_1', dtype=dtype)
  y = layers.RMSNorm(config).apply({'params': {'scale': scale}}, jnp.asarray(x, dtype))
  x64 = np.asarray(jnp.asarray(x, dtype), np.float64)  # What the layer sees.
  expected = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6) * scale
  assert y.dtype == jnp.dtype(dtype)
  tolerance = 1e-6 if dtype == 'float32' else 1e-2
  np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize('features', [1, 48, 512])
def test_rms_norm_of_a_row_is_the_same_bit_for_bit_at_any_number_of_rows(features):
  """A decode step's norms (pairwise_sum, no XLA reduction) give a position the same
  values whether the step holds one position or many: XLA's own reduction rounds
  differently past a few thousand elements, which a verify step of many rows x
  positions reaches and a one-position step does not."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(300, features)).astype(np.float32)
  scale = rng.normal(size=(features,)).astype(np.float32)
  norm = jax.jit(lambda x: layers.RMSNorm(get_config('test_tiny_1_1')).apply(
      {'params': {'scale': scale}}, x))
  rows = np.concatenate([np.asarray(norm(jnp.asarray(x[n:n + 1]))) for n in range(300)])
  for count in (7, 19, 133, 300):
    np.testing.assert_array_equal(np.asarray(norm(jnp.asarray(x[:count]))), rows[:count])
  sums = np.asarray(jax.jit(layers.pairwise_sum)(jnp.asarray(x)))  # [300, 1]
  np.testing.assert_allclose(sums[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


def table_tree(config):
  """{path: (shape, logical axes)} as the t5x-compat.md parameter table lists them."""
  e, h, f, v = config.emb_dim, config.num_heads, config.mlp_dim, config.vocab_size
  hd = h * config.head_dim
  mlp_in = ['wi'] if config.mlp_activations == ('relu',) else ['wi_0', 'wi_1']

  def norm(path):
    return {f'{path}/scale': ((e,), ('embed',))}

  def attention(path):
    tree = {f'{path}/{name}/kernel': ((e, hd), ('embed', 'joined_kv'))
            for name in ('query', 'key', 'value')}
    return {**tree, f'{path}/out/kernel': ((hd, e), ('joined_kv', 'embed'))}

  def mlp(path):
    tree = {f'{path}/{name}/kernel': ((e, f), ('embed', 'mlp')) for name in mlp_in}
    return {**tree, f'{path}/wo/kernel': ((f, e), ('mlp', 'embed'))}

  tree = {'token_embedder/embedding': ((v, e), ('vocab', 'embed'))}
  for stack in ('encoder', 'decoder'):
    tree[f'{stack}/relpos_bias/rel_embedding'] = ((h, 32), ('heads', 'relpos_buckets'))
    tree.update(norm(f'{stack}/{stack}_norm'))
  for i in range(config.num_encoder_layers):
    path = f'encoder/layers_{i}'
    tree.update({**norm(f'{path}/pre_attention_layer_norm'), **attention(f'{path}/attention'),
                 **norm(f'{path}/pre_mlp_layer_norm'), **mlp(f'{path}/mlp')})
  for i in range(config.num_decoder_layers):
    path = f'decoder/layers_{i}'
    tree.update({**norm(f'{path}/pre_self_attention_layer_norm'),
                 **attention(f'{path}/self_attention'),
                 **norm(f'{path}/pre_cross_attention_layer_norm'),
                 **attention(f'{path}/encoder_decoder_attention'),
                 **norm(f'{path}/pre_mlp_layer_norm'), **mlp(f'{path}/mlp')})
  if not config.logits_via_embedding:
    tree['decoder/logits_dense/kernel'] = ((e, v), ('embed', 'vocab'))
  return tree


@functools.lru_cache(maxsize=None)
def abstract(name):
  return abstract_params(get_config(name))


def flat(tree):
  return {'/'.join(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(
              tree, is_leaf=lambda x: hasattr(x, 'names'))[0]}


@pytest.mark.parametrize('name', ['t5_1_1_small', 't5_small'])
def test_param_tree_matches_t5x_table(name):
  variables = abstract(name)
  params, axes = flat(variables['params']), flat(variables['params_axes'])
  # params_axes holds `<path>/<param>_axes` for each parameter `<path>/<param>`.
  actual = {path: (tuple(leaf.shape), tuple(axes[path + '_axes'].names))
            for path, leaf in params.items()}
  assert actual == table_tree(get_config(name))
  assert len(axes) == len(params)
  assert {leaf.dtype for leaf in params.values()} == {jnp.dtype('float32')}


def count_from_table(config):
  """Parameters from the sizes alone: embeddings, attention, MLP, norms, bias tables."""
  e, hd, f = config.emb_dim, config.num_heads * config.head_dim, config.mlp_dim
  mlp = (len(config.mlp_activations) + 1) * e * f
  encoder_layer = 4 * e * hd + mlp + 2 * e
  decoder_layer = 8 * e * hd + mlp + 3 * e
  embeddings = (1 if config.logits_via_embedding else 2) * config.vocab_size * e
  stacks = 2 * (config.num_heads * 32 + e)  # relpos table and final norm of each stack
  return (embeddings + stacks + config.num_encoder_layers * encoder_layer
          + config.num_decoder_layers * decoder_layer)


# name: (exact count, published approximate count). T5.1.1 XXL is called "11B";
# its exact 11.135B is within 1% of 11.1B (1.2% above 11B).
PARAM_COUNTS = {
    't5_1_1_small': (76_961_152, 77e6),
    't5_1_1_xxl': (11_135_332_352, 11.1e9),
    't5_small': (60_506_624, 60.5e6),
    't5_11B': (11_307_321_344, 11.3e9),
}


@pytest.mark.parametrize('name', sorted(PARAM_COUNTS))
def test_param_counts(name):
  exact, published = PARAM_COUNTS[name]
  count = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(abstract(name)['params']))
  assert count == exact == count_from_table(get_config(name))
  assert abs(count - published) / published < 0.01

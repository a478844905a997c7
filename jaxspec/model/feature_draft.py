"""A feature-level draft head: decoder layers that read the target's final hidden states.

The head drafts the way EAGLE (Li et al., 2024) does for decoder-only models, here for an
encoder-decoder. Decoder slot j (the slot of input x_j; x_0 the start token) reads

    fuse([h_{j-1}, embed(x_j)])        h_{j-1}: the target decoder's final hidden state at
                                       slot j - 1 (after its final layer norm; 0 at slot 0)

through `config.num_decoder_layers` T5 decoder layers with their own self-attention cache
and cross-attention over the target's encoding, and predicts h_j (after its own final
norm). The target's own LM head (jaxspec.model.T5.logits_from_features) turns a predicted
h_j into the distribution of x_{j+1}, so the head never needs a vocabulary of its own, and
the token embeddings are the target's too.

With `num_feature_layers` = n > 0 (EAGLE-3's fused features), slot j also reads the
outputs of n of the target's decoder layers at slot j - 1 (jaxspec.model.t5.layer_feature:
lower layers keep what the final layer has already turned into the next token's
distribution): features [b, t, e * (1 + n)], h_{j-1} first. A slot reading the head's own
prediction (a later draft step) has no such outputs: it reads zeros there. The extra rows
of `fuse` start at zero, so a head trained without them computes the same at first.

The cross-attention keys/values are the target's LAST decoder layer's, taken from the
target's cache (they never change during a decode); the head owns only the query and
output projections of its cross-attention, so it costs no projection of the encoding.

Parameter paths: `fuse/kernel [(2 + n) e, e]` (rows: h, the embedding, the n layers),
`decoder/relpos_bias`, `decoder/layers_{i}` (T5X's decoder layer without
`encoder_decoder_attention/{key,value}`), `decoder/feature_norm`.

Entry points (call with `FeatureDraft(config).apply(params, ...)`):
  __call__(features [b, t, e (1 + n)] or [b, t, e], embeddings [b, t, e], cache)
    -> predicted features [b, t, e], cache
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import T5Config
from jaxspec.errors import InvalidSetting
from jaxspec.model import layers
from jaxspec.model.cache import DecoderCache, LayerCache
from jaxspec.model.sharding import CACHE_AXES, DRAFT, EMBED_AXES, constrain
from jaxspec.model.t5 import DecoderLayer, decoder_layers


def head_config(target_config: T5Config, num_layers: int) -> T5Config:
  """The head's T5Config: the target's layer shape with `num_layers` decoder layers (no
  fixed-width steps: a draft's rounding changes only what it proposes)."""
  return target_config.replace(num_decoder_layers=num_layers, decode_positions=0,
                               dropout_rate=0.0)


def check_feature_layers(feature_layers: tuple[int, ...], target_config: T5Config):
  """Raises InvalidSetting unless feature_layers are distinct decoder layers of the target."""
  count = target_config.num_decoder_layers
  if (len(set(feature_layers)) != len(feature_layers)
      or any(not 0 <= i < count for i in feature_layers)):
    raise InvalidSetting(f'feature_layers must be distinct decoder layers 0..{count - 1} of '
                         f'the target, got {tuple(feature_layers)}')


class HeadDecoder(nn.Module):
  """The head's layers, its relative position bias and its final norm."""
  config: T5Config
  role: str = DRAFT

  def setup(self):
    self.relpos_bias = layers.RelativePositionBias(False, self.config)
    self.layers = [DecoderLayer(self.config, self.role, name=f'layers_{i}')
                   for i in range(self.config.num_decoder_layers)]
    self.feature_norm = layers.RMSNorm(self.config)

  def __call__(self, x, cache: DecoderCache):  # x [b, t, e] -> [b, t, e], cache
    x, cache, _ = decoder_layers(self.layers, self.relpos_bias, x, cache)
    return self.feature_norm(x), cache


class FeatureDraft(nn.Module):
  """The head (module docstring). config: head_config(target config, layers);
  num_feature_layers: the target layers' outputs each slot reads beside h."""
  config: T5Config
  role: str = DRAFT
  num_feature_layers: int = 0

  def setup(self):
    # [2e] -> [e]: the previous slot's feature and this slot's token embedding, fused.
    self.fuse = layers.Dense(features=self.config.emb_dim, kernel_axes=('mlp', 'embed'),
                             config=self.config)
    self.decoder = HeadDecoder(self.config, self.role)

  def __call__(self, features, embeddings, cache: DecoderCache):
    """features [b, t, e (1 + n)] (h_{j-1} for each slot j, then the n layers' outputs) or
    [b, t, e] (h alone: the layers read zeros), embeddings [b, t, e] (of x_j), at slots
    cache.end_index + 0..t-1 -> predicted features [b, t, e] (of h_j), the cache with the
    slots' keys/values written and its end advanced by t."""
    features = as_read(features, self.config.emb_dim, self.num_feature_layers)
    dtype = self.config.compute_dtype
    width = self.config.emb_dim
    fused = jnp.concatenate([features[..., :width].astype(dtype), embeddings.astype(dtype),
                             features[..., width:].astype(dtype)], axis=-1)
    x = constrain(self.fuse(fused), EMBED_AXES, self.role)  # [b, t, e]
    return self.decoder(x, cache)


def as_read(features, width: int, num_feature_layers: int):
  """features [..., e] (a predicted h) or [..., e (1 + n)] -> [..., e (1 + n)]: what a slot
  reads, zeros for the layers' outputs a prediction does not have."""
  missing = width * (1 + num_feature_layers) - features.shape[-1]
  if missing not in (0, width * num_feature_layers):
    raise ValueError(f'features of width {features.shape[-1]}: a head of width {width} '
                     f'over {num_feature_layers} target layer(s) reads {width} or '
                     f'{width * (1 + num_feature_layers)}')
  if not missing:
    return features
  return jnp.pad(features, [(0, 0)] * (features.ndim - 1) + [(0, missing)])


def init_cache(config: T5Config, target_cache: DecoderCache, max_length: int) -> DecoderCache:
  """The head's empty cache of max_length slots: self-attention buffers [b, h, d, L] per
  head layer, each sharing the target's last decoder layer's cross-attention keys and
  values [b, h, d, s] (not copied: the same arrays)."""
  last = target_cache.layers[-1]
  batch = target_cache.batch_size
  shape = (batch, config.num_heads, config.head_dim, max_length)

  def layer() -> LayerCache:
    empty = lambda: constrain(jnp.zeros(shape, last.self_keys.dtype),  # noqa: E731
                              CACHE_AXES, DRAFT)
    return LayerCache(self_keys=empty(), self_values=empty(), cross_keys=last.cross_keys,
                      cross_values=last.cross_values)

  return DecoderCache(layers=tuple(layer() for _ in range(config.num_decoder_layers)),
                      encoder_mask=target_cache.encoder_mask,
                      end_index=jnp.zeros((batch,), jnp.int32))


def shifted_features(features):
  """features [b, t, e] of slots 0..t-1 -> [b, t, e]: what each slot reads, h_{j-1}
  (zeros at slot 0)."""
  return jnp.pad(features, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def init_params(config: T5Config, rng, length: int = 8, num_feature_layers: int = 0):
  """Randomly initialized variables {'params', 'params_axes'} of the head."""
  batch = 1
  features = jnp.zeros((batch, length, config.emb_dim * (1 + num_feature_layers)), jnp.float32)
  embeddings = jnp.zeros((batch, length, config.emb_dim), jnp.float32)
  layer_shape = (batch, config.num_heads, config.head_dim, length)
  cache = DecoderCache(
      layers=tuple(LayerCache(self_keys=jnp.zeros(layer_shape), self_values=jnp.zeros(layer_shape),
                              cross_keys=jnp.zeros(layer_shape), cross_values=jnp.zeros(layer_shape))
                   for _ in range(config.num_decoder_layers)),
      encoder_mask=jnp.ones((batch, length), bool), end_index=jnp.zeros((batch,), jnp.int32))
  return FeatureDraft(config, num_feature_layers=num_feature_layers).init(
      rng, features, embeddings, cache)


def abstract_params(config: T5Config, num_feature_layers: int = 0):
  """Shapes and dtypes of the head's variables, without allocating them."""
  return jax.eval_shape(
      lambda rng: init_params(config, rng, num_feature_layers=num_feature_layers),
      jax.random.PRNGKey(0))


def with_feature_layers(params: Mapping[str, Any], config: T5Config,
                        num_feature_layers: int) -> dict:
  """A head's {'params'} (of any number of target layers read, up to num_feature_layers)
  reading num_feature_layers: the rows `fuse` lacks added as zeros, so the head computes
  what it did (a head trained on h alone starts a run over more layers)."""
  params = dict(params.get('params', params))
  kernel = np.asarray(jax.device_get(params['fuse']['kernel']))
  rows = config.emb_dim * (2 + num_feature_layers)
  if kernel.shape[0] > rows:
    raise ValueError(f'fuse/kernel has {kernel.shape[0]} rows: it reads more target '
                     f'layers than {num_feature_layers}')
  padded = np.concatenate([kernel, np.zeros((rows - kernel.shape[0], kernel.shape[1]),
                                            kernel.dtype)])
  return {'params': {**params, 'fuse': {**params['fuse'], 'kernel': padded}}}


def from_target(target_params: Mapping[str, Any], config: T5Config, rng,
                num_feature_layers: int = 0) -> dict:
  """The head's {'params'}, started from the target: every head layer a copy of the
  target's last decoder layer (its cross-attention query and output; the keys/values are
  the target's own at decode), the target's decoder relative position bias and final norm,
  and `fuse` the sum of its two inputs plus a small random part (so slot j starts from
  h_{j-1} + embed(x_j), on the scale of the target's stream), its rows for
  num_feature_layers target layers' outputs zero. rng: for that random part."""
  params = jax.device_get(target_params)
  params = params.get('params', params)
  target_decoder = params['decoder']
  num_layers = sum(name.startswith('layers_') for name in target_decoder)
  last = target_decoder[f'layers_{num_layers - 1}']
  head = jax.device_get(init_params(config, rng)['params'])
  layer = dict(last)
  layer['encoder_decoder_attention'] = {
      name: value for name, value in last['encoder_decoder_attention'].items()
      if name in ('query', 'out')}
  width = config.emb_dim
  identity = np.concatenate([np.eye(width), np.eye(width)], axis=0)  # [2e, e]
  fuse = np.asarray(head['fuse']['kernel'], np.float32) * 0.01 + identity
  return with_feature_layers({'params': {
      'fuse': {'kernel': fuse.astype(np.asarray(head['fuse']['kernel']).dtype)},
      'decoder': {
          'relpos_bias': target_decoder['relpos_bias'],
          **{f'layers_{i}': layer for i in range(config.num_decoder_layers)},
          'feature_norm': target_decoder['decoder_norm']}}}, config, num_feature_layers)

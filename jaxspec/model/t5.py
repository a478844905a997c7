"""The T5 encoder-decoder with a multi-position cached decode step.

Parameter paths match T5X's examples network (`token_embedder`, `encoder/layers_{i}`,
`decoder/layers_{i}`, `decoder/logits_dense`), so T5X checkpoints load as they are.

Entry points (call with `T5(config).apply(params, ..., method=...)`):
  encode(encoder_tokens)                         -> encoded [b, s, e]
  init_cache(encoded, encoder_tokens, max_length) -> DecoderCache (cross K/V computed once)
  decode(decoder_tokens [b, k], cache)           -> logits [b, k, v], cache
  decode(decoder_tokens [b, k], cache, tree)     -> the same for a token tree (DecodeTree)
  decode_with_features(decoder_tokens, cache[, tree, feature_layers]) -> logits, features
    [b, k, e] (or [b, k, e * (1 + len(feature_layers))] with layers' outputs), cache
  logits_from_features(features [b, k, e])       -> logits [b, k, v] (the LM head alone)
  embed(tokens [b, k])                           -> the token embeddings [b, k, e]
  __call__(encoder_tokens, decoder_input_tokens) -> logits [b, t, v] (teacher forcing)

`decode` takes k >= 1 new tokens per row at that row's own position
`cache.end_index[b]`, writes their keys/values, and advances `end_index` by k.
With a DecodeTree the k tokens are the nodes of a tree hanging below the cached
prefix (multi-draft verification): each attends to the cache and to its own
ancestors only, at position end_index + its depth; keys/values are still written
at slots end_index + 0..k-1 (the flat index).
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.config import T5Config
from jaxspec.model import layers
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.model.cache import DecoderCache, LayerCache
from jaxspec.model.sharding import CACHE_AXES, EMBED_AXES, TARGET, VOCAB_AXES, constrain


@flax.struct.dataclass
class DecodeTree:
  """The shape of a token tree decoded in one step, the same for every row
  (jaxspec.decoding.verification.tree).

  New token i sits at depth depths[i] below the last cached position and sees new
  token j iff ancestors[i, j] (j is i or an ancestor of i).
  """
  depths: jax.Array  # [t] int32 >= 0
  ancestors: jax.Array  # [t, t] bool, True on the diagonal


def tree_attention_inputs(tree: DecodeTree, end_index, max_length: int):
  """Positions and visibility for a tree step with cache.end_index [b], L = max_length.

  -> query_positions [b, t] (end + depth), key_positions [b, L] (the slot for cached
  slots, end + depth of the new token written there for new slots) and visible
  [b, t, L]: a query sees every cached slot < end and the slots of its ancestors.
  """
  num_new = tree.depths.shape[0]
  slots = jnp.arange(max_length)[None, :]  # [1, L]
  offset = slots - end_index[:, None]  # [b, L] flat index of the new token in the slot
  is_new = (offset >= 0) & (offset < num_new)  # [b, L]
  flat = jnp.clip(offset, 0, num_new - 1)  # [b, L]
  key_positions = jnp.where(is_new, end_index[:, None] + tree.depths[flat], slots)  # [b, L]
  query_positions = end_index[:, None] + tree.depths[None, :]  # [b, t]
  ancestor_slot = jnp.moveaxis(tree.ancestors[:, flat], 0, 1)  # [b, t, L]
  visible = (offset < 0)[:, None, :] | (is_new[:, None, :] & ancestor_slot)  # [b, t, L]
  return query_positions, key_positions, visible


class EncoderLayer(nn.Module):
  config: T5Config
  role: str = TARGET  # Whose activation sharding rules apply (jaxspec.model.sharding).
  deterministic: bool = True  # False: dropout (config.dropout_rate) when training.

  @nn.compact
  def __call__(self, x, bias):  # x [b, s, e], bias [b, h, s, s]
    # One Dropout serves both sublayers: each call draws its own mask.
    drop = nn.Dropout(self.config.dropout_rate, deterministic=self.deterministic)
    y = layers.RMSNorm(self.config, name='pre_attention_layer_norm')(x)
    x = x + drop(layers.MultiHeadAttention(self.config, self.role, name='attention')(y, bias))
    y = layers.RMSNorm(self.config, name='pre_mlp_layer_norm')(x)
    return x + drop(layers.MlpBlock(self.config, self.role, self.deterministic,
                                    name='mlp')(y))


class Encoder(nn.Module):
  config: T5Config
  embedder: nn.Module
  role: str = TARGET
  deterministic: bool = True

  @nn.compact
  def __call__(self, encoder_tokens):  # [b, s] -> [b, s, e]
    config = self.config
    positions = jnp.broadcast_to(jnp.arange(encoder_tokens.shape[1]), encoder_tokens.shape)
    bias = layers.RelativePositionBias(True, config, name='relpos_bias')(positions, positions)
    mask = encoder_tokens > 0  # [b, s]
    bias = bias + layers.attention_bias_from_mask(mask[:, None, :] & mask[:, :, None])
    drop = nn.Dropout(config.dropout_rate, deterministic=self.deterministic)
    x = drop(constrain(self.embedder(encoder_tokens), EMBED_AXES, self.role))
    # No real position attends to the padding (mask), so the CPU kernels' products skip
    # its rows (zeros there): the real positions' encoding is that of a pass over every
    # row, bit for bit.
    with cpu_matmul.active_rows(mask):
      for i in range(config.num_encoder_layers):
        x = EncoderLayer(config, self.role, self.deterministic, name=f'layers_{i}')(x, bias)
    x = drop(layers.RMSNorm(config, name='encoder_norm')(x))
    return constrain(x, EMBED_AXES, self.role)


class DecoderLayer(nn.Module):
  config: T5Config
  role: str = TARGET
  deterministic: bool = True

  def setup(self):
    config = self.config
    self.pre_self_attention_layer_norm = layers.RMSNorm(config)
    self.self_attention = layers.MultiHeadAttention(config, self.role)
    self.pre_cross_attention_layer_norm = layers.RMSNorm(config)
    self.encoder_decoder_attention = layers.MultiHeadAttention(config, self.role)
    self.pre_mlp_layer_norm = layers.RMSNorm(config)
    self.mlp = layers.MlpBlock(config, self.role, self.deterministic)
    # One Dropout serves the three sublayers: each call draws its own mask.
    self.dropout = nn.Dropout(config.dropout_rate, deterministic=self.deterministic)

  def cross_key_value(self, encoded):
    """encoded [b, s, e] -> cross-attention keys, values [b, h, d, s] (the cache layout)."""
    keys, values = self.encoder_decoder_attention.project_key_value(encoded)
    return (constrain(layers.to_cache_layout(keys), CACHE_AXES, self.role),
            constrain(layers.to_cache_layout(values), CACHE_AXES, self.role))

  def __call__(self, x, layer_cache: LayerCache, write_positions, self_bias, cross_bias):
    """x [b, t, e]; write_positions [b, t]; biases [b, h|1, t, L] and [b, 1, t, s]."""
    y = self.pre_self_attention_layer_norm(x)
    # [b, t, h, d] each
    queries, new_keys, new_values = self.self_attention.project_query_key_value(y)
    # The step's keys/values go into the cache at write_positions (end_index + 0..t-1);
    # its queries see slots up to the last one it writes, never past it.
    attended, keys, values = self.self_attention.attend_writing(
        queries, new_keys, new_values, layer_cache.self_keys, layer_cache.self_values,
        self_bias, write_positions[:, 0])
    keys, values = (constrain(keys, CACHE_AXES, self.role),
                    constrain(values, CACHE_AXES, self.role))
    x = x + self.dropout(attended)
    y = self.pre_cross_attention_layer_norm(x)
    x = x + self.dropout(self.encoder_decoder_attention.attend_cached(
        self.encoder_decoder_attention.project_query(y), layer_cache.cross_keys,
        layer_cache.cross_values, cross_bias))
    y = self.pre_mlp_layer_norm(x)
    x = x + self.dropout(self.mlp(y))
    return x, layer_cache.replace(self_keys=keys, self_values=values)


class Decoder(nn.Module):
  config: T5Config
  embedder: nn.Module
  role: str = TARGET
  deterministic: bool = True

  def setup(self):
    config = self.config
    self.relpos_bias = layers.RelativePositionBias(False, config)
    self.layers = [DecoderLayer(config, self.role, self.deterministic, name=f'layers_{i}')
                   for i in range(config.num_decoder_layers)]
    self.decoder_norm = layers.RMSNorm(config)
    self.dropout = nn.Dropout(config.dropout_rate, deterministic=self.deterministic)
    if not config.logits_via_embedding:
      self.logits_dense = layers.Dense(
          features=config.vocab_size, kernel_axes=('embed', 'vocab'), config=config,
          dtype=jnp.float32)

  def init_cache(self, encoded, encoder_tokens, max_length: int) -> DecoderCache:
    config = self.config
    batch = encoded.shape[0]
    self_shape = (batch, config.num_heads, config.head_dim, max_length)  # [b, h, d, L]
    empty = lambda: constrain(jnp.zeros(self_shape, config.compute_dtype),  # noqa: E731
                              CACHE_AXES, self.role)
    layer_caches = []
    encoder_mask = encoder_tokens > 0  # [b, s]
    # The padding's cross-attention keys/values are masked (encoder_mask): the CPU
    # kernels skip their rows (zeros there).
    with cpu_matmul.active_rows(encoder_mask):
      for layer in self.layers:
        cross_keys, cross_values = layer.cross_key_value(encoded)
        layer_caches.append(LayerCache(self_keys=empty(), self_values=empty(),
                                       cross_keys=cross_keys, cross_values=cross_values))
    return DecoderCache(layers=tuple(layer_caches), encoder_mask=encoder_mask,
                        end_index=jnp.zeros((batch,), jnp.int32))

  def __call__(self, decoder_tokens, cache: DecoderCache, tree: DecodeTree | None = None,
               with_features: bool = False, feature_layers: tuple[int, ...] = ()):
    """decoder_tokens [b, t] -> logits [b, t, v] float32, updated cache; with_features:
    logits, the final hidden states [b, t, e] (after the final layer norm: what the
    logits are a product of), cache. feature_layers (with_features): the outputs of these
    decoder layers (0-based), each RMS-normalized without a scale (layer_feature), follow
    the final hidden states along the last axis: features [b, t, e * (1 + n)].

    tree: the new tokens form a DecodeTree (positions by depth, ancestor mask) instead
    of a sequence; they are still written at slots end_index + 0..t-1.

    With config.decode_positions = w > t (a target's, no tree) the step runs over w
    positions, the last w - t padding: their keys and values land in slots past the new
    end_index (stale slots, rewritten before any query sees them, or dropped past the
    buffer) and their logits are dropped.
    """
    num_new = decoder_tokens.shape[1]
    width = layers.fixed_step_width(self.config, self.role)
    # Every product of the step through the CPU kernel whatever its rows (where it runs):
    # the logits of a row are then the same at every step width.
    with cpu_matmul.decode_step():
      if tree is None and num_new < width:
        padded = jnp.pad(decoder_tokens, ((0, 0), (0, width - num_new)))  # [b, w]
        logits, features, new_cache = self._step(padded, cache, None, feature_layers)
        logits, features = logits[:, :num_new], features[:, :num_new]
        new_cache = new_cache.replace(end_index=cache.end_index + num_new)
      else:
        logits, features, new_cache = self._step(decoder_tokens, cache, tree, feature_layers)
    return (logits, features, new_cache) if with_features else (logits, new_cache)

  def _step(self, decoder_tokens, cache: DecoderCache, tree: DecodeTree | None,
            feature_layers: tuple[int, ...] = ()):
    """-> logits [b, t, v], features [b, t, e * (1 + len(feature_layers))] (the final
    hidden states, then the listed layers' outputs), cache."""
    x = self.dropout(constrain(self.embedder(decoder_tokens), EMBED_AXES, self.role))
    x, new_cache, outputs = decoder_layers(self.layers, self.relpos_bias, x, cache, tree,
                                           outputs_of=feature_layers)
    x = self.dropout(self.decoder_norm(x))
    features = jnp.concatenate([x, *(layer_feature(y).astype(x.dtype) for y in outputs)],
                               axis=-1)
    return self.logits(x), features, new_cache

  def logits(self, features):
    """features [b, t, e] (after the final layer norm) -> logits [b, t, v] float32."""
    if self.config.logits_via_embedding:
      logits = self.embedder.attend(features) / math.sqrt(features.shape[-1])
    else:
      logits = self.logits_dense(features)
    return constrain(logits, VOCAB_AXES, self.role)


def layer_feature(x):
  """A decoder layer's output [..., e] as a drafter reads it: RMS-normalized, no scale
  (the residual stream's size grows with depth; the reader's projection scales it): the
  target's final norm without its scale, the same bit for bit at any step width."""
  x = x.astype(jnp.float32)
  variance = layers.pairwise_sum(jnp.square(x)) / x.shape[-1]  # [..., 1]
  return x * jax.lax.rsqrt(variance + layers.LAYER_NORM_EPSILON)


def decoder_layers(layer_modules, relpos_bias, x, cache: DecoderCache,
                   tree: DecodeTree | None = None, outputs_of: tuple[int, ...] = ()):
  """x [b, t, e] through decoder layers at slots cache.end_index + 0..t-1 (causal, or a
  DecodeTree) -> x [b, t, e], the cache with each layer's keys/values written and its end
  advanced by t, and the outputs [b, t, e] of the layers listed in outputs_of (0-based,
  in that order; () by default). relpos_bias: the decoder's RelativePositionBias module."""
  num_new = x.shape[1]
  write_positions = cache.end_index[:, None] + jnp.arange(num_new)[None, :]  # [b, t]
  if tree is None:
    query_positions = write_positions
    key_positions = jnp.broadcast_to(jnp.arange(cache.max_length),
                                     (cache.batch_size, cache.max_length))  # [b, L]
    # Causal: a query sees cached positions and new ones up to itself; slots past it
    # (stale after a rollback, or never written) are masked.
    visible = key_positions[:, None, :] <= query_positions[:, :, None]  # [b, t, L]
  else:
    query_positions, key_positions, visible = tree_attention_inputs(
        tree, cache.end_index, cache.max_length)
  self_bias = (relpos_bias(query_positions, key_positions)
               + layers.attention_bias_from_mask(visible))  # [b, h, t, L]
  cross_bias = layers.attention_bias_from_mask(
      jnp.broadcast_to(cache.encoder_mask[:, None, :],
                       (cache.batch_size, num_new, cache.encoder_mask.shape[1])))
  new_layer_caches, outputs = [], {}
  for index, (layer, layer_cache) in enumerate(zip(layer_modules, cache.layers)):
    x, layer_cache = layer(x, layer_cache, write_positions, self_bias, cross_bias)
    new_layer_caches.append(layer_cache)
    outputs[index] = x
  return (x, cache.replace(layers=tuple(new_layer_caches), end_index=cache.end_index + num_new),
          tuple(outputs[i] for i in outputs_of))


class T5(nn.Module):
  config: T5Config
  # Whose activation sharding rules apply: 'target' or 'draft' (jaxspec.model.sharding);
  # no effect outside an activation_sharding block.
  role: str = TARGET
  # False when training: dropout at config.dropout_rate (the 'dropout' rng) on the
  # embeddings, every sublayer's output, the MLP's hidden activations and the final
  # norms' outputs, as T5X places it (not on the attention weights). Decoding keeps True.
  deterministic: bool = True

  def setup(self):
    self.token_embedder = layers.Embed(self.config)
    self.encoder = Encoder(self.config, self.token_embedder, self.role, self.deterministic)
    self.decoder = Decoder(self.config, self.token_embedder, self.role, self.deterministic)

  def encode(self, encoder_tokens):
    """encoder_tokens [b, s] int32 (0 = padding) -> encoded [b, s, e] (the padding's rows
    are not meaningful: the CPU kernels skip their products, see Encoder)."""
    return self.encoder(encoder_tokens)

  def init_cache(self, encoded, encoder_tokens, max_length: int) -> DecoderCache:
    """An empty cache of `max_length` decoder positions with cross K/V of `encoded`."""
    return self.decoder.init_cache(encoded, encoder_tokens, max_length)

  def decode(self, decoder_tokens, cache: DecoderCache, tree: DecodeTree | None = None):
    """decoder_tokens [b, k] at positions cache.end_index[b] + 0..k-1 -> logits, cache.

    With a DecodeTree, at positions end_index + tree.depths, each token seeing the cache
    and its ancestors (slots are still end_index + 0..k-1)."""
    return self.decoder(decoder_tokens, cache, tree)

  def decode_with_features(self, decoder_tokens, cache: DecoderCache,
                           tree: DecodeTree | None = None, feature_layers: tuple[int, ...] = ()):
    """As decode -> logits [b, k, v], the final hidden states [b, k, e] the logits are
    computed from (after the final layer norm), cache. feature_layers: decoder layers
    (0-based) whose outputs (layer_feature) follow the final states: features
    [b, k, e * (1 + len(feature_layers))]."""
    return self.decoder(decoder_tokens, cache, tree, with_features=True,
                        feature_layers=tuple(feature_layers))

  def logits_from_features(self, features):
    """features [b, k, e] (final hidden states) -> logits [b, k, v]: the LM head alone
    (the tied embedding or logits_dense), as decode computes it."""
    return self.decoder.logits(features)

  def embed(self, tokens):
    """tokens [b, k] int32 -> the token embeddings [b, k, e] the decoder reads."""
    return self.token_embedder(tokens)

  def __call__(self, encoder_tokens, decoder_input_tokens):
    """Teacher-forced logits [b, t, v] for decoder inputs [b, t] (shifted right)."""
    encoded = self.encode(encoder_tokens)
    cache = self.init_cache(encoded, encoder_tokens, decoder_input_tokens.shape[1])
    logits, _ = self.decode(decoder_input_tokens, cache)
    return logits


def init_params(config: T5Config, rng, encoder_length: int = 8, decoder_length: int = 8):
  """Randomly initialized variables {'params', 'params_axes'} for `config`."""
  encoder_tokens = jnp.ones((1, encoder_length), jnp.int32)
  decoder_tokens = jnp.ones((1, decoder_length), jnp.int32)
  return T5(config).init(rng, encoder_tokens, decoder_tokens)


def abstract_params(config: T5Config):
  """Shapes and dtypes of the variables, without allocating them."""
  return jax.eval_shape(lambda rng: init_params(config, rng), jax.random.PRNGKey(0))

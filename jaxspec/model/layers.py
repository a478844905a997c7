"""T5 building blocks with T5X's parameter names, shapes and logical axes.

Shape letters: b batch, t query length, s key length, h heads, d head dim,
e embed, f mlp, v vocab.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
from flax.linen.partitioning import param_with_axes
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import DECODE_ATTENTION_JAX, T5Config
from jaxspec.model.accelerator import attention as accelerator_attention
from jaxspec.model.cpu import attention as cpu_attention, matmul as cpu_matmul
from jaxspec.model.sharding import (EMBED_AXES, HEADS_AXES, JOINED_KV_AXES, MLP_AXES, TARGET,
                                    constrain)

NEG_INF = cpu_attention.NEG_INF  # Additive mask value, as T5X.
KERNEL_PARAM = 'kernel'  # A Dense kernel in T5X's layout [in, out].
KERNEL_T_PARAM = 'kernel_t'  # The same kernel transposed, [out, in] (jaxspec.model.cpu.layout).
# The same kernel tiled with the outputs in vector lanes, [out / 16, in, 16]
# (jaxspec.model.cpu.layout's 'tiled' layout, jaxspec.model.cpu.matmul.tile_kernel).
KERNEL_TILES_PARAM = 'kernel_tiles'
# A decoder self-attention's query/key/value kernels stacked, [e, 3, h*d], and a gated
# MLP's wi_0/wi_1 stacked, [e, 2, f]: one product each (jaxspec.model.accelerator.layout).
KERNEL_QKV = 'qkv_kernel'
KERNEL_WI = 'wi_kernel'
# An int8 kernel [out, in] and its float32 scale per output (jaxspec.model.quantization).
KERNEL_INT8 = 'kernel_int8'
KERNEL_SCALE = 'kernel_scale'
# An int8 embedding table [vocab, embed], or tiled [vocab / 64, embed / 4, 64, 4] for the
# kernel's logits (jaxspec.model.quantization.tile_int8) ...
EMBEDDING_INT8 = 'embedding_int8'
EMBEDDING_SCALE = 'embedding_scale'  # ... and its float32 scale per token [vocab].
LAYER_NORM_EPSILON = 1e-6

default_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')


def fixed_step_width(config: T5Config, role: str) -> int:
  """The width every cached decode step of this model runs at (0: as wide as its
  tokens): config.decode_positions for a target; a draft's steps stay as they are, since
  its rounding changes only what it proposes."""
  return config.decode_positions if role == TARGET else 0


def pairwise_sum(values):
  """values [..., n] -> [..., 1]: their sum in one fixed order (halves added pairwise, n
  padded with zeros to a power of two), with no reduction for XLA to order: XLA:CPU sums a
  reduction in an order that depends on the array's shape (past a few thousand elements
  it takes another path), so a row's mean would round differently in a decode step of
  many positions than in a one-position step. Elementwise additions round alike
  whatever the shape."""
  count = values.shape[-1]
  width = 1 << max(count - 1, 0).bit_length()
  values = jnp.pad(values, ((0, 0),) * (values.ndim - 1) + ((0, width - count),))
  while values.shape[-1] > 1:
    half = values.shape[-1] // 2
    values = values[..., :half] + values[..., half:]
  return values


class RMSNorm(nn.Module):
  """T5 layer norm: x * rsqrt(mean(x^2) + eps) * scale, computed in float32; the mean
  in a fixed order (pairwise_sum), so that each position's norm is the same bit for bit
  whatever the step's width."""
  config: T5Config

  @nn.compact
  def __call__(self, x):  # [..., e] -> [..., e]
    scale = param_with_axes('scale', nn.initializers.ones, (x.shape[-1],),
                            jnp.dtype(self.config.param_dtype), axes=('embed',))
    x = x.astype(jnp.float32)
    variance = pairwise_sum(jnp.square(x)) / x.shape[-1]  # [..., 1]
    y = x * jax.lax.rsqrt(variance + LAYER_NORM_EPSILON)
    return (y * scale.astype(jnp.float32)).astype(self.config.compute_dtype)


class Dense(nn.Module):
  """A bias-free projection with a 2-D kernel.

  The kernel is stored as T5X stores it, `kernel` [in_features, out_features], or
  transposed as `kernel_t` [out_features, in_features] (the decode layout for XLA:CPU,
  made by jaxspec.model.cpu.layout), or tiled as `kernel_tiles` [out / 16, in, 16] (that
  layout where the kernel's AVX-512 build runs, jaxspec.model.cpu.matmul.tile_kernel);
  the module uses whichever the params hold.
  A transposed kernel applied to a few positions on CPU runs through jaxspec's few-row
  kernel (jaxspec.model.cpu.matmul) unless config.cpu_matmul is 'xla'. Params made by
  jaxspec.model.quantization hold `kernel_int8` [out, in] and `kernel_scale` [out]
  instead: the product is then (x @ kernel_int8^T) * kernel_scale in float32 (int8
  drafts). Initialization creates `kernel`.
  """
  features: int
  kernel_axes: tuple[str, str]
  config: T5Config
  kernel_init: nn.initializers.Initializer = default_kernel_init
  dtype: jnp.dtype | None = None  # Defaults to the config's compute dtype.

  @nn.compact
  def __call__(self, x):  # [..., in] -> [..., out]
    dtype = self.dtype or self.config.compute_dtype
    param_dtype = jnp.dtype(self.config.param_dtype)
    if self.has_variable('params', KERNEL_INT8):
      kernel_int8 = self.param(KERNEL_INT8, _existing,
                               _int8_shape(self.get_variable('params', KERNEL_INT8),
                                           self.features, x.shape[-1]), jnp.int8)
      scale = self.param(KERNEL_SCALE, _existing, (self.features,), jnp.float32)
      return cpu_matmul.matmul_int8(x, kernel_int8, scale, self.config.cpu_matmul).astype(dtype)
    if self.has_variable('params', KERNEL_TILES_PARAM):
      tiles = self.param(KERNEL_TILES_PARAM, _existing,
                         (self.features // cpu_matmul.FLOAT_TILE_OUTPUTS, x.shape[-1],
                          cpu_matmul.FLOAT_TILE_OUTPUTS), param_dtype)
      return cpu_matmul.matmul_transposed(x.astype(dtype), tiles.astype(dtype),
                                          self.config.cpu_matmul)
    if self.has_variable('params', KERNEL_T_PARAM):
      kernel_t = param_with_axes(KERNEL_T_PARAM, _transposed_init(self.kernel_init),
                                 (self.features, x.shape[-1]), param_dtype,
                                 axes=self.kernel_axes[::-1])
      return cpu_matmul.matmul_transposed(x.astype(dtype), kernel_t.astype(dtype),
                                          self.config.cpu_matmul)
    kernel = param_with_axes(KERNEL_PARAM, self.kernel_init, (x.shape[-1], self.features),
                             param_dtype, axes=self.kernel_axes)
    return jnp.dot(x.astype(dtype), kernel.astype(dtype))

  def decode_weights(self):
    """The params this projection decodes with, read without declaring them:
    (KERNEL_INT8, kernel_int8, kernel_scale), (KERNEL_T_PARAM, kernel_t),
    (KERNEL_TILES_PARAM, tiles), or None (T5X's
    layout, or params not made yet: init)."""
    if self.has_variable('params', KERNEL_INT8):
      return (KERNEL_INT8, self.get_variable('params', KERNEL_INT8),
              self.get_variable('params', KERNEL_SCALE))
    if self.has_variable('params', KERNEL_T_PARAM):
      return (KERNEL_T_PARAM, self.get_variable('params', KERNEL_T_PARAM))
    if self.has_variable('params', KERNEL_TILES_PARAM):
      return (KERNEL_TILES_PARAM, self.get_variable('params', KERNEL_TILES_PARAM))
    return None


def project_together(x, projections, config: T5Config):
  """(projection(x) for projection in projections), Dense modules over the same x
  [..., in]: ONE call of the few-row kernel where they all hold transposed (or all
  tiled, or all int8) kernels and it applies (jaxspec.model.cpu.matmul.matmuls_transposed /
  matmuls_int8: results bit-identical to separate calls; a mix of transposed and tiled
  kernels goes one product each), else each on its own."""
  weights = [projection.decode_weights() for projection in projections]
  dtype = config.compute_dtype
  if all(w is not None and w[0] in (KERNEL_T_PARAM, KERNEL_TILES_PARAM) for w in weights):
    return cpu_matmul.matmuls_transposed(
        x.astype(dtype), [w[1].astype(dtype) for w in weights], config.cpu_matmul)
  if all(w is not None and w[0] == KERNEL_INT8 for w in weights):
    return tuple(y.astype(dtype) for y in cpu_matmul.matmuls_int8(
        x, [(w[1], w[2]) for w in weights], config.cpu_matmul))
  return tuple(projection(x) for projection in projections)


def project_stacked(x, kernel, dtype):
  """x [..., in] against n kernels stacked as kernel [in, n, out] -> n results [..., out],
  in ONE product (the accelerator layout's q/k/v and wi_0/wi_1)."""
  stacked = jnp.einsum('...i,ino->...no', x.astype(dtype), kernel.astype(dtype))  # [..., n, out]
  return tuple(stacked[..., i, :] for i in range(kernel.shape[1]))


def _int8_shape(existing, out: int, inputs: int) -> tuple[int, ...]:
  """The shape int8 weights of [out, in] have in the form `existing` is stored in:
  [out, in], or tiled [out / 64, in / 4, 64, 4] (jaxspec.model.quantization.tile_int8)."""
  return cpu_matmul.tiled_int8_shape(out, inputs) if existing.ndim == 4 else (out, inputs)


def _existing(rng, shape, dtype):
  """The init of int8 params, which are read only where the params hold them (Flax
  evaluates it abstractly to check their shapes): they are made from float params by
  jaxspec.model.quantization, never initialized."""
  return jnp.zeros(shape, dtype)


def _transposed_init(kernel_init):
  """An initializer of [out, in] with the statistics of kernel_init's [in, out]."""
  return lambda rng, shape, dtype: kernel_init(rng, shape[::-1], dtype).T


class Embed(nn.Module):
  """Token embedding table [vocab, embed]; `attend` gives tied logits.

  Params made by jaxspec.model.quantization hold `embedding_int8` [vocab, embed] (or the
  same table in the kernel's tiles, [vocab / 64, embed / 4, 64, 4], which both the lookup
  and the tied logits read) and `embedding_scale` [vocab] instead (int8 drafts): row v of
  the table is embedding_int8[v] * embedding_scale[v].
  """
  config: T5Config

  def setup(self):
    shape = (self.config.vocab_size, self.config.emb_dim)
    if self.has_variable('params', EMBEDDING_INT8):
      self.embedding_int8 = self.param(
          EMBEDDING_INT8, _existing,
          _int8_shape(self.get_variable('params', EMBEDDING_INT8), *shape), jnp.int8)
      self.embedding_scale = self.param(EMBEDDING_SCALE, _existing, shape[:1],
                                        jnp.float32)
      return
    self.embedding = param_with_axes(
        'embedding', nn.initializers.normal(stddev=1.0), shape,
        jnp.dtype(self.config.param_dtype), axes=('vocab', 'embed'))

  @property
  def is_int8(self) -> bool:
    return self.has_variable('params', EMBEDDING_INT8)

  def __call__(self, tokens):  # [b, t] int -> [b, t, e]
    if self.is_int8:
      rows = cpu_matmul.int8_rows(self.embedding_int8, tokens).astype(jnp.float32)
      scale = jnp.take(self.embedding_scale, tokens, axis=0)[..., None]
      return (rows * scale).astype(self.config.compute_dtype)
    return jnp.take(self.embedding, tokens, axis=0).astype(self.config.compute_dtype)

  def attend(self, x):  # [b, t, e] -> [b, t, v] float32
    if self.is_int8:
      return cpu_matmul.matmul_int8(x, self.embedding_int8, self.embedding_scale,
                                    self.config.cpu_matmul)
    # The table is [v, e], the [out, in] layout: a few positions run through the few-row
    # kernel on CPU; otherwise XLA contracts into [b, v, t] and swaps, since XLA:CPU runs
    # x @ embedding.T several times slower once t >= 2 (a verify step).
    return cpu_matmul.matmul_transposed(x.astype(jnp.float32),
                                        self.embedding.astype(jnp.float32),
                                        self.config.cpu_matmul)


def relative_position_bucket(relative_position, bidirectional: bool,
                             num_buckets: int = 32, max_distance: int = 128):
  """Maps key_pos - query_pos to T5's relative position buckets (int32, same shape)."""
  n = -jnp.asarray(relative_position, jnp.int32)
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # Guard log(0); the exact branch covers n < max_exact anyway.
  scaled = (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact + np.finfo(np.float32).eps)
            / math.log(max_distance / max_exact) * (num_buckets - max_exact))
  large = jnp.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
  return bucket + jnp.where(is_small, n, large)


class RelativePositionBias(nn.Module):
  """Per-head bias from relative position buckets; one table for all layers."""
  bidirectional: bool
  config: T5Config

  @nn.compact
  def __call__(self, query_positions, key_positions):
    """query_positions [b, t], key_positions [b, s] -> bias [b, h, t, s] float32."""
    config = self.config
    table = param_with_axes(
        'rel_embedding', nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform'),
        (config.num_heads, config.relative_attention_num_buckets),
        jnp.dtype(config.param_dtype), axes=('heads', 'relpos_buckets'))
    relative = key_positions[:, None, :] - query_positions[:, :, None]  # [b, t, s]
    buckets = relative_position_bucket(
        relative, self.bidirectional, config.relative_attention_num_buckets,
        config.relative_attention_max_distance)
    bias = jnp.take(table.astype(jnp.float32), buckets, axis=1)  # [h, b, t, s]
    return jnp.transpose(bias, (1, 0, 2, 3))


def attention_bias_from_mask(mask):
  """Boolean mask [b, t, s] -> additive bias [b, 1, t, s] float32 (0 or NEG_INF)."""
  return jnp.where(mask, 0.0, NEG_INF).astype(jnp.float32)[:, None, :, :]


def dot_product_attention(query, key, value, bias):
  """query [b,t,h,d], key/value [b,s,h,d], bias [b,h|1,t,s] -> [b,t,h,d].

  No 1/sqrt(d) scaling: T5 folds it into the query initializer.
  """
  logits = jnp.einsum('bthd,bshd->bhts', query, key,
                      preferred_element_type=jnp.float32)  # [b, h, t, s]
  weights = jax.nn.softmax(logits + bias, axis=-1).astype(value.dtype)
  return jnp.einsum('bhts,bshd->bthd', weights, value)


def to_cache_layout(x):
  """Keys or values [b, s, h, d] -> [b, h, d, s], the cache layout."""
  return jnp.transpose(x, (0, 2, 3, 1))


class MultiHeadAttention(nn.Module):
  """T5X's attention parameters: query/key/value [e, h*d] and out [h*d, e]."""
  config: T5Config
  role: str = TARGET  # Whose activation sharding rules apply (jaxspec.model.sharding).

  def setup(self):
    config = self.config
    joined = config.num_heads * config.head_dim
    depth_scaling = math.sqrt(config.head_dim)
    base_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal')

    def query_init(*args):
      return base_init(*args) / depth_scaling

    projection = functools.partial(Dense, features=joined, kernel_axes=('embed', 'joined_kv'),
                                   config=config, kernel_init=base_init)
    self.query = projection(kernel_init=query_init)
    self.key = projection()
    self.value = projection()
    self.out = Dense(features=config.emb_dim, kernel_axes=('joined_kv', 'embed'),
                     config=config, kernel_init=base_init)
    if self.has_variable('params', KERNEL_QKV):  # the accelerator layout: q/k/v stacked
      self.query_key_value = param_with_axes(
          KERNEL_QKV, _existing, (config.emb_dim, 3, joined), jnp.dtype(config.param_dtype),
          axes=('embed', 'stack', 'joined_kv'))

  def _split_heads(self, x):  # [b, t, h*d] -> [b, t, h, d]
    x = x.reshape(x.shape[:-1] + (self.config.num_heads, self.config.head_dim))
    return constrain(x, HEADS_AXES, self.role)

  def project_query(self, x):
    return self._split_heads(self.query(x))

  def project_key_value(self, x):
    """x [b, s, e] -> keys, values [b, s, h, d], in one kernel call on CPU
    (project_together: bit-identical to two)."""
    keys, values = project_together(x, (self.key, self.value), self.config)
    return self._split_heads(keys), self._split_heads(values)

  def project_query_key_value(self, x):
    """x [b, t, e] -> queries, keys, values [b, t, h, d], in one product where the params
    stack them (the accelerator layout), else in one kernel call on CPU (project_together)."""
    if self.has_variable('params', KERNEL_QKV):
      projected = project_stacked(x, self.query_key_value, self.config.compute_dtype)
    else:
      projected = project_together(x, (self.query, self.key, self.value), self.config)
    return tuple(self._split_heads(y) for y in projected)

  def _through_dot_product_attention(self, kernel_takes_shapes: bool) -> bool:
    """Whether a decode step's attention goes to jax.nn.dot_product_attention
    (config.decode_attention): wherever XLA computes it, not where the CPU kernel does."""
    return (self.config.decode_attention == DECODE_ATTENTION_JAX
            and not (kernel_takes_shapes and cpu_matmul.use_kernel(self.config.cpu_matmul)))

  def attend_cached(self, query, keys, values, bias):
    """query [b,t,h,d] against cached keys/values [b,h,d,s] (jaxspec.model.cache) -> [b, t, e]
    (on CPU through the attention kernel, jaxspec.model.cpu.attention; with
    config.decode_attention 'dot_product_attention' elsewhere through
    jaxspec.model.accelerator.attention)."""
    if self._through_dot_product_attention(cpu_attention.applies(query, keys, values, bias)):
      out = accelerator_attention.cached_attention(query, keys, values, bias)
    else:
      out = cpu_attention.cached_attention(query, keys, values, bias,
                                           cpu_matmul_setting=self.config.cpu_matmul)
    out = constrain(out.reshape(out.shape[:2] + (-1,)), JOINED_KV_AXES, self.role)
    return constrain(self.out(out), EMBED_AXES, self.role)

  def attend_writing(self, query, new_keys, new_values, keys, values, bias, starts):
    """A decode step's self-attention with its cache write: new keys/values [b,t,h,d]
    go into the cached keys/values [b,h,d,s] at slots starts[b] + 0..t-1, then query
    [b,t,h,d] attends over them -> ([b, t, e], keys, values)
    (jaxspec.model.cpu.attention.attend_and_write)."""
    keys_in_slots = fixed_step_width(self.config, self.role) > 0
    if self._through_dot_product_attention(cpu_attention.applies_write(
        query, new_keys, new_values, keys, values, bias)):
      out, keys, values = accelerator_attention.attend_and_write(
          query, new_keys, new_values, keys, values, bias, starts, keys_in_slots)
    else:
      out, keys, values = cpu_attention.attend_and_write(
          query, new_keys, new_values, keys, values, bias, starts, self.config.cpu_matmul,
          keys_in_slots=keys_in_slots)
    out = constrain(out.reshape(out.shape[:2] + (-1,)), JOINED_KV_AXES, self.role)
    return constrain(self.out(out), EMBED_AXES, self.role), keys, values

  def attend(self, query, keys, values, bias):
    """query [b,t,h,d] against keys/values [b,s,h,d] with bias -> [b, t, e]."""
    out = dot_product_attention(query, keys, values, bias)  # [b, t, h, d]
    out = constrain(out.reshape(out.shape[:2] + (-1,)), JOINED_KV_AXES, self.role)
    return constrain(self.out(out), EMBED_AXES, self.role)

  def __call__(self, x, bias):
    """Self-attention over x [b, t, e] without a cache (the encoder)."""
    queries, keys, values = self.project_query_key_value(x)
    return self.attend(queries, keys, values, bias)


class MlpBlock(nn.Module):
  """Gated GELU (wi_0, wi_1; T5.1.1) or ReLU (wi; T5 1.0), then wo (dropout on the
  hidden activations when training, as T5X's MlpBlock)."""
  config: T5Config
  role: str = TARGET
  deterministic: bool = True

  @nn.compact
  def __call__(self, x):  # [b, t, e] -> [b, t, e]
    config = self.config
    dense_in = functools.partial(Dense, features=config.mlp_dim, kernel_axes=('embed', 'mlp'),
                                 config=config)
    if config.mlp_activations == ('relu',):
      hidden = nn.relu(dense_in(name='wi')(x))
    else:
      if self.has_variable('params', KERNEL_WI):  # the accelerator layout: one product
        kernel = param_with_axes(KERNEL_WI, _existing, (x.shape[-1], 2, config.mlp_dim),
                                 jnp.dtype(config.param_dtype), axes=('embed', 'stack', 'mlp'))
        gate, linear = project_stacked(x, kernel, config.compute_dtype)  # [b, t, f] each
      else:
        gate, linear = project_together(x, (dense_in(name='wi_0'), dense_in(name='wi_1')),
                                        config)
      hidden = nn.gelu(gate, approximate=True) * linear
    hidden = nn.Dropout(config.dropout_rate, deterministic=self.deterministic)(
        constrain(hidden, MLP_AXES, self.role))
    out = Dense(features=config.emb_dim, kernel_axes=('mlp', 'embed'), config=config,
                name='wo')(hidden)
    return constrain(out, EMBED_AXES, self.role)

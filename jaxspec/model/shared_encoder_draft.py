"""An encoder-sharing draft: a T5 decoder that cross-attends to the TARGET's encoder output.

The draft has no encoder of its own. Its cross-attention reads the target's encoded
input (after the target's final encoder norm), projected to the draft's width by one
learned dense layer when the widths differ, so drafting costs no encoder pass and the
draft sees the source as the target does (distil-whisper's design for encoder-decoders).

Parameter paths follow T5X's decoder: `token_embedder`, `decoder/relpos_bias`,
`decoder/layers_{i}`, `decoder/decoder_norm`, `decoder/logits_dense` (untied logits),
plus `encoder_projection/kernel [encoder_dim, emb_dim]` when the widths differ. The
decoder and its cache are those of `jaxspec.model.t5`, so `rollback` applies unchanged.

The draft's `T5Config` describes its decoder; its encoder fields are unused.

Entry points (call with `SharedEncoderDraft(config, encoder_dim).apply(params, ...)`):
  init_cache(target_encoded, encoder_tokens, max_length) -> DecoderCache
  decode(decoder_tokens [b, k], cache)                   -> logits [b, k, v], cache
  __call__(target_encoded, encoder_tokens, decoder_input_tokens) -> logits (teacher forcing)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec.config import T5Config
from jaxspec.model import layers
from jaxspec.model.cache import DecoderCache
from jaxspec.model.sharding import DRAFT, EMBED_AXES, constrain
from jaxspec.model.t5 import Decoder


def needs_projection(config: T5Config, encoder_dim: int) -> bool:
  """Whether the target's encoder output [.., encoder_dim] must be projected to emb_dim."""
  return encoder_dim != config.emb_dim


class SharedEncoderDraft(nn.Module):
  config: T5Config  # The draft decoder (its encoder fields are unused).
  encoder_dim: int  # Width of the target's encoder output: the target's emb_dim.
  role: str = DRAFT  # Whose activation sharding rules apply (jaxspec.model.sharding).

  def setup(self):
    if self.encoder_dim < 1:
      raise ValueError(f'encoder_dim must be >= 1, got {self.encoder_dim}')
    self.token_embedder = layers.Embed(self.config)
    if needs_projection(self.config, self.encoder_dim):
      self.encoder_projection = layers.Dense(
          features=self.config.emb_dim, kernel_axes=('embed', 'embed'), config=self.config)
    self.decoder = Decoder(self.config, self.token_embedder, self.role)

  def project(self, target_encoded):
    """target_encoded [b, s, encoder_dim] -> [b, s, emb_dim] in the draft's width."""
    if target_encoded.shape[-1] != self.encoder_dim:
      raise ValueError(
          f'the target encoder output has width {target_encoded.shape[-1]}, but this '
          f'draft reads encoder_dim={self.encoder_dim}; set encoder_dim to the target '
          "config's emb_dim")
    if not needs_projection(self.config, self.encoder_dim):
      return target_encoded.astype(self.config.compute_dtype)
    return constrain(self.encoder_projection(target_encoded), EMBED_AXES, self.role)

  def init_cache(self, target_encoded, encoder_tokens, max_length: int) -> DecoderCache:
    """An empty cache of `max_length` positions; cross K/V of the projected encoding."""
    return self.decoder.init_cache(self.project(target_encoded), encoder_tokens, max_length)

  def decode(self, decoder_tokens, cache: DecoderCache):
    """decoder_tokens [b, k] at positions cache.end_index[b] + 0..k-1 -> logits, cache."""
    return self.decoder(decoder_tokens, cache)

  def __call__(self, target_encoded, encoder_tokens, decoder_input_tokens):
    """Teacher-forced logits [b, t, v] for decoder inputs [b, t] (shifted right)."""
    cache = self.init_cache(target_encoded, encoder_tokens, decoder_input_tokens.shape[1])
    logits, _ = self.decode(decoder_input_tokens, cache)
    return logits


def init_params(config: T5Config, encoder_dim: int, rng, encoder_length: int = 8,
                decoder_length: int = 8):
  """Randomly initialized variables {'params', 'params_axes'} of the draft."""
  target_encoded = jnp.zeros((1, encoder_length, encoder_dim), config.compute_dtype)
  encoder_tokens = jnp.ones((1, encoder_length), jnp.int32)
  decoder_tokens = jnp.ones((1, decoder_length), jnp.int32)
  return SharedEncoderDraft(config, encoder_dim).init(
      rng, target_encoded, encoder_tokens, decoder_tokens)


def abstract_params(config: T5Config, encoder_dim: int):
  """Shapes and dtypes of the draft's variables, without allocating them."""
  return jax.eval_shape(lambda rng: init_params(config, encoder_dim, rng),
                        jax.random.PRNGKey(0))


def from_target_decoder(target_params, layers=None):
  """The draft made of a target's own decoder: {'params'} without the encoder subtree.

  With equal widths (no projection) this draft computes exactly the target's decoder,
  which makes it a reference in tests and a starting point for training. layers: the
  target decoder layers to keep, in order (None: all); the draft's layer i is the
  target's layers[i] (a layer-pruned draft, e.g. the first and last: (0, 5)).
  """
  params = target_params['params']
  draft = {name: tree for name, tree in params.items() if name != 'encoder'}
  if layers is None:
    return {'params': draft}
  decoder = draft['decoder']
  available = sorted(int(name[len('layers_'):]) for name in decoder if name.startswith('layers_'))
  if not layers or any(l not in available for l in layers) or len(set(layers)) != len(layers):
    raise ValueError(f'layers must name distinct target decoder layers {available}, got '
                     f'{tuple(layers)}')
  pruned = {name: tree for name, tree in decoder.items() if not name.startswith('layers_')}
  pruned.update({f'layers_{i}': decoder[f'layers_{l}'] for i, l in enumerate(layers)})
  draft['decoder'] = pruned
  return {'params': draft}

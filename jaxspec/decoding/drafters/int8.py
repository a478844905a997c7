"""The int8 draft: the target's own decoder with int8 weights, over the target's encoding.

A decode step on CPU is bound by reading the decoder's weights, so the target's decoder
with each per-step matrix in int8 (jaxspec.model.quantization: a quarter of the float32
bytes, read by the few-row kernel's int8 handler) steps several times faster than the
target while proposing nearly the target's own tokens: on the 45M EnDe pair it agrees
with the target at about 98% of positions, at temperature 0 and 1 alike (README). It
needs no training and no checkpoint of its own: its params are made from the target's
when the target is loaded (`draft_params`).

Like SharedEncoderDrafter (which it is, with the target's decoder shape), it cross-
attends to the target's encoder output, so drafting costs no encoder pass; its
cross-attention keys/values are the target's own (float32 projections), so in
speculative decoding it takes them from the target's cache
(`init_state_from_target_cache`) instead of projecting the encoding a second time. Proposals,
rollback and exactness are those of every cached-decoder drafter: the float32 target
verifies every draft, so the output is the target's whatever the draft proposes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxspec.config import OMIT_AT_DEFAULT
from jaxspec.errors import InvalidSetting
from jaxspec.decoding.drafters.base import DraftSources
from jaxspec.decoding.drafters.shared_encoder import SharedEncoderDrafter
from jaxspec.model.cache import DecoderCache, LayerCache
from jaxspec.model.quantization import int8_decoder
from jaxspec.model.sharding import CACHE_AXES, DRAFT, constrain


@dataclasses.dataclass(frozen=True)
class Int8Drafter(SharedEncoderDrafter):
  """The target's decoder in int8 as a draft.

  config: the TARGET's T5Config (the draft has its decoder's shape); encoder_dim
    defaults to, and must equal, config.emb_dim. weights: always 'int8'.
  params: `draft_params(target_params)`.
  """
  encoder_dim: int = 0
  weights: str = dataclasses.field(default='int8', metadata=OMIT_AT_DEFAULT)

  shares_target_cache = True  # init_state_for_decode reads the target's cross cache.

  def __post_init__(self):
    if self.weights != 'int8':
      raise InvalidSetting(f"an int8 draft has int8 weights; got weights={self.weights!r}")
    if self.encoder_dim == 0:
      object.__setattr__(self, 'encoder_dim', self.config.emb_dim)
    if self.encoder_dim != self.config.emb_dim:
      raise InvalidSetting(
          f'an int8 draft is the target decoder itself: encoder_dim must equal the target '
          f'config emb_dim {self.config.emb_dim}, got {self.encoder_dim}')
    super().__post_init__()

  @staticmethod
  def draft_params(target_params: Mapping[str, Any]):
    """The draft's {'params'} on the default device, made from the target's variables."""
    return jax.device_put(int8_decoder(target_params))

  def load_params(self, sources: DraftSources):
    """Made from the target's params (no checkpoint of its own); replicated with a
    partitioner."""
    if sources.checkpoint:
      raise InvalidSetting('an int8 draft is made from the target checkpoint; unset '
                           f'{sources.setting}.draft_checkpoint ({sources.checkpoint!r})')
    if sources.target_params is None:
      raise InvalidSetting("an int8 draft needs the target's params")
    if sources.partitioner:
      return sources.replicated(int8_decoder(jax.device_get(sources.target_params)))
    return self.draft_params(sources.target_params)

  def init_state_for_decode(self, params, encoder_tokens, target_encoded, max_length: int,
                            target_cache=None):
    """From the target's cache where there is one (its cross-attention keys/values
    shared), else from the target's encoding."""
    if target_cache is not None:
      return self.init_state_from_target_cache(params, target_cache, max_length)
    return self.init_state_from_target(params, encoder_tokens, target_encoded, max_length)

  def init_state_from_target_cache(self, params, target_cache: DecoderCache,
                                   max_length: int) -> DecoderCache:
    """The draft's DecoderCache of max_length: empty self-attention buffers and the
    target's cross-attention keys/values [b, h, d, s], shared, not recomputed."""
    del params  # The cross-attention projections are the target's.

    def layer(target_layer: LayerCache) -> LayerCache:
      batch, heads, head_dim, _ = target_layer.self_keys.shape
      empty = lambda: constrain(  # noqa: E731
          jnp.zeros((batch, heads, head_dim, max_length), target_layer.self_keys.dtype),
          CACHE_AXES, DRAFT)
      return LayerCache(self_keys=empty(), self_values=empty(),
                        cross_keys=constrain(target_layer.cross_keys, CACHE_AXES, DRAFT),
                        cross_values=constrain(target_layer.cross_values, CACHE_AXES, DRAFT))

    return DecoderCache(layers=tuple(layer(c) for c in target_cache.layers),
                        encoder_mask=target_cache.encoder_mask,
                        end_index=jnp.zeros_like(target_cache.end_index))

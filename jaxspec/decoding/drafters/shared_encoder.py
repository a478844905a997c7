"""A drafter that shares the target's encoder: a draft decoder over the target's encoding.

Speculative decoding encodes the input once, with the target, and hands that encoder
output to `init_state_from_target`; the draft decoder (jaxspec.model.shared_encoder_draft)
projects it to its own width if needed and computes its cross-attention keys/values
from it. Drafting then costs the draft decoder's steps only, never an encoder pass.
Proposals are those of T5Drafter (roll back by index, one two-input step, gamma - 1
single steps), so exactness rests on the same verify step as for every drafter.

`SharedEncoderDrafterWithTarget` runs stand-alone (its params carry the target's, and
`init_state` encodes with the target's encoder) for measurements that call a drafter
outside speculative decoding, such as the acceptance-rate and step-cost benchmarks.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxspec.checkpoints import shared_encoder_draft as shared_encoder_checkpoints
from jaxspec.config import OMIT_AT_DEFAULT, T5Config
from jaxspec.errors import InvalidSetting
from jaxspec.decoding.drafters.base import DraftContext, Drafter, DraftSources
from jaxspec.decoding.drafters.t5 import CachedDecoderDrafter
from jaxspec.model import T5
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model.quantization import int8_decoder
from jaxspec.model.sharding import DRAFT
from jaxspec.model.shared_encoder_draft import SharedEncoderDraft
from jaxspec.sampling import SamplingConfig


WEIGHTS = ('float32', 'int8')


@dataclasses.dataclass(frozen=True)
class SharedEncoderDrafter(CachedDecoderDrafter):
  """A draft decoder cross-attending to the target's encoder output.

  config: the draft decoder (vocabulary, width, heads, decoder layers, MLP); its
    encoder fields are unused. encoder_dim: the target's emb_dim.
  weights: 'float32' (the checkpoint's weights as they are) or 'int8' (each per-step
    matrix quantized when the checkpoint loads, jaxspec.model.quantization: a quarter
    of the bytes a step reads; the cross-attention projections of the encoding stay
    float32). `decoding_params` makes either from the checkpoint's tree.
  params: the draft's variables {'params': ...} (no encoder).
  """
  config: T5Config
  encoder_dim: int
  weights: str = dataclasses.field(default='float32', metadata=OMIT_AT_DEFAULT)

  def __post_init__(self):
    if self.encoder_dim < 1:
      raise InvalidSetting(f'encoder_dim must be >= 1 (the target emb_dim), got {self.encoder_dim}')
    if self.weights not in WEIGHTS:
      raise InvalidSetting(f'weights must be one of {WEIGHTS}, got {self.weights!r}')

  def decoding_params(self, checkpoint_params):
    """{'params'} to decode with, on the default device, from a checkpoint's 'params'
    tree (T5X kernel layout): transposed for decoding, int8 where `weights` says so."""
    if self.weights == 'int8':
      return jax.device_put(int8_decoder({'params': checkpoint_params}))
    return {'params': jax.device_put(kernel_layout.for_decoding(checkpoint_params))}

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def model(self) -> SharedEncoderDraft:
    return SharedEncoderDraft(self.config, self.encoder_dim, role=DRAFT)

  def init_state(self, params, encoder_tokens, max_length: int):
    raise ValueError(
        "SharedEncoderDrafter drafts from the target's encoder output and has no encoder "
        'of its own: speculative decoding passes that output to init_state_from_target; '
        'to run it stand-alone use SharedEncoderDrafterWithTarget')

  def init_state_from_target(self, params, encoder_tokens, target_encoded, max_length: int):
    """target_encoded [b, s, encoder_dim] -> the draft's DecoderCache of max_length."""
    return self.model().apply(params, target_encoded, encoder_tokens, max_length,
                              method=SharedEncoderDraft.init_cache)

  def init_state_for_decode(self, params, encoder_tokens, target_encoded, max_length: int,
                            target_cache=None):
    """The draft's cache over the target's encoding (init_state_from_target)."""
    del target_cache
    return self.init_state_from_target(params, encoder_tokens, target_encoded, max_length)

  def load_params(self, sources: DraftSources):
    """The draft's own checkpoint (T5X legacy layout, no encoder), as decoding_params
    makes it (int8 where `weights` says so); replicated with a partitioner."""
    checkpoint = sources.require_checkpoint('a shared-encoder drafter')
    return sources.replicated(self.decoding_params(shared_encoder_checkpoints.load(
        checkpoint, self.config, self.encoder_dim, dtype=self.config.param_dtype)))

  def decoder(self, params):
    """decode(tokens [b, k], cache) -> (logits [b, k, v], cache) of the draft decoder."""
    model = self.model()
    return lambda tokens, cache: model.apply(params, tokens, cache,
                                             method=SharedEncoderDraft.decode)

  def teacher_forced_logits(self, params, target_encoded, encoder_tokens, decoder_inputs):
    """Logits [b, t, v] at every position of decoder inputs [b, t] (shifted right)."""
    return self.model().apply(params, target_encoded, encoder_tokens, decoder_inputs)


@dataclasses.dataclass(frozen=True)
class SharedEncoderDrafterWithTarget(Drafter):
  """`drafter` made stand-alone: params {'draft': draft variables, 'target': the
  target's variables}; `init_state` runs the target's encoder. Inside speculative
  decoding `init_state_from_target` reuses the target's encoding instead.
  """
  drafter: SharedEncoderDrafter
  target_config: T5Config

  def __post_init__(self):
    if self.target_config.emb_dim != self.drafter.encoder_dim:
      raise ValueError(f'the target emb_dim {self.target_config.emb_dim} differs from the '
                       f"draft's encoder_dim {self.drafter.encoder_dim}")

  @property
  def vocab_size(self) -> int:
    return self.drafter.vocab_size

  def encode(self, params, encoder_tokens):
    """encoder_tokens [b, s] -> the target's encoder output [b, s, encoder_dim]."""
    return T5(self.target_config).apply(params['target'], encoder_tokens, method=T5.encode)

  def init_state(self, params, encoder_tokens, max_length: int):
    return self.drafter.init_state_from_target(
        params['draft'], encoder_tokens, self.encode(params, encoder_tokens), max_length)

  def init_state_from_target(self, params, encoder_tokens, target_encoded, max_length: int):
    return self.drafter.init_state_from_target(params['draft'], encoder_tokens,
                                               target_encoded, max_length)

  @property
  def shares_target_cache(self) -> bool:
    """The wrapped drafter's: True for the int8 draft."""
    return self.drafter.shares_target_cache

  @property
  def proposes_top_branches(self) -> bool:
    return self.drafter.proposes_top_branches

  def init_state_for_decode(self, params, encoder_tokens, target_encoded, max_length: int,
                            target_cache=None):
    """The wrapped drafter's, reading params['draft']: the target's cross-attention
    cache for the int8 draft, the encoding otherwise."""
    return self.drafter.init_state_for_decode(params['draft'], encoder_tokens, target_encoded,
                                              max_length, target_cache)

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    return self.drafter.propose(params['draft'], state, context, gamma, sampling, keys)

  def propose_with_confidence(self, params, state, context: DraftContext, gamma: int,
                              sampling: SamplingConfig, keys, stop_below: float):
    return self.drafter.propose_with_confidence(params['draft'], state, context, gamma,
                                                sampling, keys, stop_below)

  def propose_coupled(self, params, state, context: DraftContext, gamma: int,
                      sampling: SamplingConfig, position_keys, keys=None):
    return self.drafter.propose_coupled(params['draft'], state, context, gamma, sampling,
                                        position_keys, keys)

  def propose_top_branches(self, params, state, context: DraftContext, gamma: int,
                           num_branches: int):
    return self.drafter.propose_top_branches(params['draft'], state, context, gamma,
                                             num_branches)

  def teacher_forced_logits(self, params, encoder_tokens, decoder_inputs):
    """Logits [b, t, v] of the draft at every position, the target encoding once."""
    return self.drafter.teacher_forced_logits(
        params['draft'], self.encode(params, encoder_tokens), encoder_tokens, decoder_inputs)

"""The feature-level draft: a head of one or two decoder layers over the target's features.

FeatureDrafter drafts with a head (jaxspec.model.feature_draft) that reads, at decoder slot
j, the target's final hidden state h_{j-1} and the embedding of x_j, predicts h_j, and
draws x_{j+1} from the target's own LM head over it. A proposal after `length` committed
tokens:

  1. one step over a window of gamma + 1 slots from `caught_up` (the first slot whose
     input the head has read only with a PREDICTED feature, or not at all): every slot
     up to `length` now reads the target's true feature, which the target's verify step
     computed (the catch-up, with no extra target pass), and slot `length` predicts
     h_length, the first draft's distribution; the window's slots past `length` are
     rewritten before any query reads them;
  2. gamma - 1 one-slot steps, each reading the feature the head predicted at the slot
     before (later draft steps feed on the head's own predictions, as in training's
     second pass).

After each verify step the speculative loop hands the drafter the target's features of
every verified slot (Drafter.observe_target_features): the verify step over x_length,
d_1..d_g computes h_length..h_{length+g}, which slots length + 1 .. length + g + 1 read.
Slots past the next committed length hold features of rejected drafts until a later
verify step rewrites them; they are only ever read past `length`, by window slots whose
outputs are dropped.

With `feature_layers` (EAGLE-3's fused features) the verify step also returns those target
decoder layers' outputs (jaxspec.model.t5.layer_feature) beside h, and slot j reads them
of slot j - 1 too; draft steps reading a predicted feature read zeros there.

The head's cross-attention keys/values are the target's last decoder layer's, shared from
the target's cache; its token embeddings and LM head are the target's (params['target']),
so the head adds only its own layers (params['head']). Exact as every drafter: the target
verifies every draft.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.checkpoints import feature_draft as head_checkpoints
from jaxspec.config import T5Config
from jaxspec.errors import InvalidSetting
from jaxspec.decoding.drafters.base import DraftContext, Drafter, DraftSources
from jaxspec.decoding.drafters.t5 import (propose_coupled_from_decoder, propose_from_decoder,
                                          propose_top_branches_from_decoder,
                                          propose_until_unsure)
from jaxspec.model import T5, DecoderCache, feature_draft, rollback
from jaxspec.model.cpu import layout as kernel_layout, matmul as cpu_matmul
from jaxspec.model.quantization import int8_tree
from jaxspec.model.sharding import DRAFT
from jaxspec.sampling import SamplingConfig


WEIGHTS = ('float32', 'int8')


@flax.struct.dataclass
class FeatureDraftState:
  """The drafter's state inside speculative decoding."""
  cache: DecoderCache  # the head's; end_index is the slot its next step writes
  # [b, L, e (1 + n)] the target's features each slot reads: h_{j-1} at slot j (0 at slot
  # 0), then n layers' outputs, where a verify step computed them (stale past the
  # committed length).
  slot_features: jax.Array
  caught_up: jax.Array  # [b] int32: slots before it were read with the target's features
  last_feature: jax.Array  # [b, e] the head's latest predicted feature (within a proposal)


def target_head_params(target_params: Mapping[str, Any]) -> dict:
  """The part of the target's variables the head drafts through: {'params':
  {'token_embedder', and 'decoder/logits_dense' where the logits are untied}}."""
  params = target_params.get('params', target_params)
  subset = {'token_embedder': params['token_embedder']}
  if 'logits_dense' in params.get('decoder', {}):
    subset['decoder'] = {'logits_dense': params['decoder']['logits_dense']}
  return {'params': subset}


@dataclasses.dataclass(frozen=True)
class FeatureDrafter(Drafter):
  """A feature-level draft head over the target (module docstring).

  config: the TARGET's T5Config (the head has its layer shape). num_layers: the head's
  decoder layers (1 or 2). weights: 'float32', or 'int8' (the head's kernels and the
  target's embedding and LM head in int8, jaxspec.model.quantization, read by the CPU's
  few-row kernel: a draft step then reads a quarter of the bytes; exactness is the
  verifier's either way). params: {'head': {'params'}, 'target': target_head_params(...)}
  (`load_params`, or `make_params(head_params, target_params, weights)`).
  feature_layers: the target decoder layers (0-based) whose outputs the head reads beside
  h (module docstring); as the head was trained.
  """
  config: T5Config
  num_layers: int = 1
  weights: str = 'float32'
  feature_layers: tuple[int, ...] = ()

  shares_target_cache = True  # init_state_for_decode reads the target's cross cache.
  reads_target_features = True  # observe_target_features keeps the verify steps' h.
  proposes_top_branches = True

  def __post_init__(self):
    if self.num_layers < 1:
      raise InvalidSetting(f'a feature draft head has at least one layer, got num_layers '
                       f'{self.num_layers}')
    if self.weights not in WEIGHTS:
      raise InvalidSetting(f'a feature draft head has weights in {WEIGHTS}, got {self.weights!r}')
    feature_draft.check_feature_layers(tuple(self.feature_layers), self.config)
    object.__setattr__(self, 'feature_layers', tuple(self.feature_layers))

  @property
  def target_feature_layers(self) -> tuple[int, ...]:
    return self.feature_layers

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def head_config(self) -> T5Config:
    return feature_draft.head_config(self.config, self.num_layers)

  @staticmethod
  def make_params(head_params: Mapping[str, Any], target_params: Mapping[str, Any],
                  weights: str = 'float32') -> dict:
    """The drafter's params from the head's tree ({'params'} or bare) and the target's
    variables: in the platform's decoding layout, or in int8 (weights 'int8')."""
    head = head_params.get('params', head_params)
    target = target_head_params(target_params)
    if weights == 'int8':
      return jax.device_put({'head': {'params': int8_tree(head)},
                             'target': {'params': int8_tree(target['params'])}})
    return {'head': kernel_layout.for_decoding({'params': head}), 'target': target}

  def load_params(self, sources: DraftSources):
    """The head's checkpoint (infer.draft_checkpoint) and the target's embedding and LM
    head (replicated with a partitioner)."""
    checkpoint = sources.require_checkpoint('a feature draft head')
    if sources.target_params is None:
      raise InvalidSetting("a feature draft head drafts through the target's LM head: it needs "
                       "the target's params")
    head = head_checkpoints.load(checkpoint, self.head_config, dtype=self.config.param_dtype,
                                 num_feature_layers=len(self.feature_layers))
    params = self.make_params(head, jax.device_get(sources.target_params), self.weights)
    return sources.replicated(params) if sources.partitioner else jax.device_put(params)

  def init_state(self, params, encoder_tokens, max_length: int):
    raise InvalidSetting("a feature draft head reads the target's features and cross-attention "
                     'cache: it drafts only inside speculative decoding '
                     '(init_state_for_decode with the target cache)')

  def init_state_for_decode(self, params, encoder_tokens, target_encoded, max_length: int,
                            target_cache=None):
    """The head's empty cache of max_length slots (the target's last layer's cross K/V
    shared), no features known but slot 0's (zeros)."""
    del params, encoder_tokens
    if target_cache is None:
      return self.init_state(None, None, max_length)
    batch = target_cache.batch_size
    width = self.config.emb_dim
    read = width * (1 + len(self.feature_layers))
    return FeatureDraftState(
        cache=feature_draft.init_cache(self.head_config, target_cache, max_length),
        slot_features=jnp.zeros((batch, max_length, read), target_encoded.dtype),
        caught_up=jnp.zeros((batch,), jnp.int32),
        last_feature=jnp.zeros((batch, width), target_encoded.dtype))

  def observe_target_features(self, params, state: FeatureDraftState, features, start):
    """features [b, k, e (1 + n)]: the target's at slots start[b] + 0..k-1 of its verify
    step (h, then the feature_layers' outputs); slot start + i + 1 reads the i-th."""
    del params
    rows = jnp.arange(features.shape[0])[:, None]
    slots = start[:, None] + 1 + jnp.arange(features.shape[1])[None, :]  # [b, k]
    slot_features = state.slot_features.at[rows, slots].set(
        features.astype(state.slot_features.dtype), mode='drop')
    return state.replace(slot_features=slot_features)

  # The proposal routes: the cached-decoder ones, started by the window step.

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    return propose_from_decoder(self._decode(params), state, context, gamma, sampling, keys,
                                first_step=self._first_step(params, gamma))

  def propose_with_confidence(self, params, state, context: DraftContext, gamma: int,
                              sampling: SamplingConfig, keys, stop_below: float):
    return propose_until_unsure(self._decode(params), state, context, gamma, sampling, keys,
                                stop_below, first_step=self._first_step(params, gamma))

  def propose_coupled(self, params, state, context: DraftContext, gamma: int,
                      sampling: SamplingConfig, position_keys, keys=None):
    del keys
    return propose_coupled_from_decoder(self._decode(params), state, context, gamma,
                                        sampling, position_keys,
                                        first_step=self._first_step(params, gamma))

  def propose_top_branches(self, params, state, context: DraftContext, gamma: int,
                           num_branches: int):
    return propose_top_branches_from_decoder(self._decode(params), state, context, gamma,
                                             num_branches,
                                             first_step=self._first_step(params, gamma))

  # The head's steps.

  def _head(self, params, features, tokens, cache: DecoderCache):
    """features [b, t, e (1 + n)] or [b, t, e] (predicted), tokens [b, t] at slots
    cache.end_index + 0..t-1 -> predicted features [b, t, e], cache."""
    target = T5(self.config, role=DRAFT)
    with cpu_matmul.decode_step():
      embeddings = target.apply(params['target'], tokens, method=T5.embed)
      return feature_draft.FeatureDraft(
          self.head_config, num_feature_layers=len(self.feature_layers)).apply(
              params['head'], features, embeddings, cache)

  def _logits(self, params, features):
    """features [b, t, e] -> logits [b, t, v] through the target's LM head."""
    with cpu_matmul.decode_step():
      return T5(self.config, role=DRAFT).apply(params['target'], features,
                                               method=T5.logits_from_features)

  def _decode(self, params):
    """decode(tokens [b, 1], state) -> (logits [b, 1, v], state): one slot reading the
    feature the head predicted last."""
    def decode(tokens, state: FeatureDraftState):
      predicted, cache = self._head(params, state.last_feature[:, None], tokens, state.cache)
      return (self._logits(params, predicted),
              state.replace(cache=cache, last_feature=predicted[:, 0]))
    return decode

  def _first_step(self, params, gamma: int):
    """first_step(decode, state, context) -> (logits after x_length [b, v], state at
    length + 1): the window of gamma + 1 slots from caught_up (module docstring)."""
    def first_step(decode, state: FeatureDraftState, context: DraftContext):
      del decode
      start = state.caught_up  # [b]; length - start is in [0, gamma]
      slots = start[:, None] + jnp.arange(gamma + 1)[None, :]  # [b, g+1]
      padded = jnp.pad(context.tokens, ((0, 0), (1, 0)))  # [b, 1 + L]; padded[:, j] = x_j
      tokens = jnp.take_along_axis(padded, jnp.minimum(slots, padded.shape[1] - 1), axis=1)
      features = jnp.take_along_axis(
          state.slot_features,
          jnp.minimum(slots, state.slot_features.shape[1] - 1)[..., None], axis=1)
      predicted, cache = self._head(params, features, tokens, rollback(state.cache, start))
      index = jnp.clip(context.length - start, 0, gamma)  # [b]
      last = jnp.take_along_axis(predicted, index[:, None, None], axis=1)  # [b, 1, e]
      logits = self._logits(params, last)[:, 0]  # [b, v]
      return logits, state.replace(cache=rollback(cache, context.length + 1),
                                   caught_up=context.length + 1, last_feature=last[:, 0])
    return first_step


@dataclasses.dataclass(frozen=True)
class FeatureDrafterWithTarget(Drafter):
  """`drafter` made stand-alone, for measuring its proposals: params {'draft': the head's
  drafter params, 'target': the target's variables}; `init_state` runs the target's
  encoder and builds its cache, whose cross-attention keys/values the head shares. No
  verify step hands it the target's features, so its proposals read slot features of 0:
  what they cost, not what they agree."""
  drafter: FeatureDrafter
  target_config: T5Config

  @property
  def vocab_size(self) -> int:
    return self.drafter.vocab_size

  def init_state(self, params, encoder_tokens, max_length: int):
    model = T5(self.target_config)
    encoded = model.apply(params['target'], encoder_tokens, method=T5.encode)
    cache = model.apply(params['target'], encoded, encoder_tokens, max_length,
                        method=T5.init_cache)
    return self.drafter.init_state_for_decode(params['draft'], encoder_tokens, encoded,
                                              max_length, cache)

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    return self.drafter.propose(params['draft'], state, context, gamma, sampling, keys)

"""The drafter interface: what proposes gamma tokens for the target to verify.

A drafter is a frozen dataclass (hashable, static under jit) subclassing `Drafter`,
whose learned or fitted tables live in a separate `params` pytree. Each iteration of
speculative decoding calls `propose` once; it sees the committed prefix through a
DraftContext and returns gamma tokens with the standardized distribution q each was
drawn from. Deterministic drafters return one-hot q.

Every drafter implements `vocab_size`, `init_state` and `propose`. The optional
capabilities have default implementations on `Drafter`, which subclasses override
where they do better; the decoders call them unconditionally, never probing:

  init_state_for_decode(params, encoder_tokens, target_encoded, max_length, target_cache)
      the per-generation state inside speculative decoding. Default: `init_state`
      (the drafter encodes the input itself). Encoder-sharing drafters read the
      target's encoder output instead; the int8 draft (shares_target_cache) reuses the
      target's cross-attention cache rather than projecting the encoding again.
  propose_with_confidence(..., stop_below)
      adaptive gamma: drafts with the confidence of each (draft_confidence). Default:
      `propose`, confidence the largest probability of q. T5 drafters skip the steps
      after every row has drafted a token below stop_below.
  propose_coupled(..., position_keys, keys)
      coupled verification: each draft drawn as the baseline draws its position,
      argmax(adjusted logits + that position's Gumbel noise), returning the noise.
      Default: `propose`'s tokens and no noise (still exact, agreeing less often).
  propose_top_branches(..., num_branches)   (where proposes_top_branches)
      a greedy token tree for multi-draft verification at temperature 0. Drafters
      without it decode multi-draft at temperature 0 as one draft.
  load_params(sources)
      the params pytree from what a launcher has (DraftSources): a checkpoint, the
      target's params, token data to fit tables on. Default: no params, `()`.
  catch_up(params, state, context, window)
      the state once the last `window` inputs are read (a proposer inside a
      StagedDrafter). Default: the state unchanged; cached decoders decode them.
  stats(state)
      what the drafter counted over a decode (SpeculativeOutput.drafter_stats).
      Default: None.
  observe_target_features(params, state, features, start)   (where reads_target_features)
      the state once it knows the target's final hidden states [b, k, e] of the verify
      step just run, at positions start[b] + 0..k-1 (a feature-level head reads them
      instead of its own predictions). Default: the state unchanged; the speculative loop
      computes and hands them only to drafters that read them.

Implementations (all importable from `jaxspec.decoding.drafters` and `jaxspec`):
T5Drafter (t5.py); FeatureDrafter (feature.py); SharedEncoderDrafter and its stand-alone wrapper (shared_encoder.py);
Int8Drafter (int8.py); UnigramDrafter, BigramDrafter with fit_unigram and fit_bigram
(ngram.py); PromptLookupDrafter (prompt_lookup.py); StagedDrafter (staged.py), a
cached-decoder drafter itself decoded speculatively with a cheaper proposer.

Positions: the decoder input sequence is x_0 = 0 (start), x_j = tokens[j-1]. With
`length` committed tokens the next token to predict is tokens[length], from the
prefix x_0..x_length. The first proposal of a decode sees length 0 (only x_0): the
target verifies the drafter's first tokens too, and draws no token on its own.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.sampling import SamplingConfig, argmax, sample_probs
from jaxspec.errors import InvalidSetting


@flax.struct.dataclass
class DraftContext:
  """The committed state a drafter conditions on."""
  tokens: jax.Array  # [b, max_decode_length] committed output tokens, 0 past `length`
  length: jax.Array  # [b] int32 >= 0, number of committed tokens
  encoder_tokens: jax.Array  # [b, s] int32, 0 = padding
  # Set by callers that cut each row's proposal at its first drafted EOS (drafts after
  # it can never be committed): a drafter may then stop drafting a row there.
  eos_id: int | None = flax.struct.field(pytree_node=False, default=None)
  # How a drafter that decodes step by step loops over its draft steps
  # (jaxspec.decoding.drafters.loops): 'early_exit', 'static' or 'auto' (early exit on
  # the CPU, static elsewhere). The drafts are the same either way.
  draft_loop: str = flax.struct.field(pytree_node=False, default='auto')

  def last_two_inputs(self):
    """[b, 2]: decoder inputs x_{length-1}, x_length (x_0 is the start token 0); at
    length 0, where x_{-1} does not exist, [x_0, x_0]."""
    padded = jnp.pad(self.tokens, ((0, 0), (1, 0)))  # [b, 1 + L]; padded[:, j] = x_j
    positions = jnp.maximum(self.length[:, None] + jnp.array([-1, 0]), 0)  # [b, 2]
    return jnp.take_along_axis(padded, positions, axis=1)

  def last_input(self):
    """[b]: x_length, the input whose next token the drafter proposes first."""
    return self.last_two_inputs()[:, 1]

  def finished(self):
    """[b] bool: rows whose decode has ended (a committed EOS, with eos_id set, or a
    full buffer); what is drafted for them is never judged."""
    full = self.length >= self.tokens.shape[1]
    if self.eos_id is None:
      return full
    return full | ((self.length > 0) & (self.last_input() == self.eos_id))


def drafts_through_first(stops):
  """stops [b, g] bool -> [b] int32: each row's drafts up to and including its first
  stop (g without one), e.g. `drafts == eos_id`: drafts after a row's first EOS can
  never be committed, so callers that set DraftContext.eos_id treat them as not
  proposed."""
  gamma = stops.shape[1]
  return jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1,
                   gamma).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DraftSources:
  """What a drafter's params can be made from (Drafter.load_params): launchers and
  benchmarks fill in what they have."""
  checkpoint: str | None = None  # a T5X checkpoint of the draft's own
  target_params: Any = None  # the target's variables {'params': ...}
  # () -> target token sequences [n] int32 (EOS-terminated) to fit tables on; called
  # only by drafters that fit (n-gram), so reading a corpus costs nothing otherwise.
  train_targets: Callable[[], Sequence[np.ndarray]] | None = None
  # A jaxspec.partitioning.Partitioner: checkpoints are read straight into the draft's
  # shardings and other params placed replicated on its mesh. None: the default device.
  partitioner: Any = None
  setting: str = 'infer'  # the launcher's gin prefix, named in errors ('infer', ...)

  def replicated(self, params):
    """params placed replicated on the partitioner's mesh (as they are without one)."""
    return self.partitioner.place_replicated(params) if self.partitioner else params

  def require_checkpoint(self, what: str) -> str:
    if not self.checkpoint:
      raise InvalidSetting(f'{what} needs {self.setting}.draft_checkpoint')
    return self.checkpoint


class Drafter(abc.ABC):
  """The interface every drafter implements: three methods, and optional capabilities
  with defaults (module docstring)."""

  # The drafter's state in speculative decoding shares the target's cross-attention
  # cache (init_state_for_decode reads target_cache).
  shares_target_cache: ClassVar[bool] = False
  # propose_top_branches is implemented (multi-draft trees at temperature 0).
  proposes_top_branches: ClassVar[bool] = False
  # observe_target_features reads the target's final hidden states of each verify step.
  reads_target_features: ClassVar[bool] = False
  # The target decoder layers whose outputs the verify step hands observe_target_features
  # beside the final hidden states (jaxspec.model.T5.decode_with_features); () for h alone.
  target_feature_layers: ClassVar[tuple[int, ...]] = ()

  # The vocabulary drafts are drawn from (the target's): a dataclass field or a property.
  vocab_size: int

  @abc.abstractmethod
  def init_state(self, params, encoder_tokens, max_length: int) -> Any:
    """Per-generation state (e.g. an encoded cache) for encoder_tokens [b, s].

    max_length: decoder positions the state must hold (max_decode_length + gamma).
    """

  @abc.abstractmethod
  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys) -> tuple[jax.Array, jax.Array, Any]:
    """-> draft tokens [b, gamma] int32, their q [b, gamma, v] float32, new state.

    keys [b]: one PRNG key per row for this iteration. With context.eos_id set, the
    positions after a row's first drafted EOS, and after the first draft of a row
    context.finished() names, may come back undrafted (token 0, q 0).
    """

  def init_state_for_decode(self, params, encoder_tokens, target_encoded, max_length: int,
                            target_cache=None):
    """The state inside speculative decoding: target_encoded [b, s, e] is the target's
    encoder output and target_cache its DecoderCache (None where there is none, e.g.
    stand-alone measurements). Default: init_state, the drafter encoding by itself."""
    del target_encoded, target_cache
    return self.init_state(params, encoder_tokens, max_length)

  def propose_with_confidence(self, params, state, context: DraftContext, gamma: int,
                              sampling: SamplingConfig, keys, stop_below: float):
    """-> drafts [b, g], q [b, g, v], confidence [b, g], new state (adaptive gamma).

    Default: propose as usual, with the largest probability of q as the confidence (1
    for one-hot q); no steps are skipped. Drafters that decode step by step report
    draft_confidence and may skip the steps after every row has drafted a token below
    stop_below (those positions come back as token 0, q 0, confidence 0).
    """
    del stop_below
    drafts, probs, state = self.propose(params, state, context, gamma, sampling, keys)
    return drafts, probs, jnp.max(probs, axis=-1), state

  def propose_coupled(self, params, state, context: DraftContext, gamma: int,
                      sampling: SamplingConfig, position_keys, keys):
    """-> drafts [b, g], their noise [b, g, v] or None, new state (coupled verification).

    position_keys [b, g]: the keys of the output positions length .. length + g - 1
    (None at temperature 0, where drafts are argmax picks and no noise is returned).
    Default: propose with keys [b] (q unused), no noise. Any drafts keep coupled
    verification exact; drafts drawn with the target's noise agree with its draws more
    often (T5 drafters override this).
    """
    del position_keys
    drafts, _, state = self.propose(params, state, context, gamma, sampling, keys)
    return drafts, None, state

  def propose_top_branches(self, params, state, context: DraftContext, gamma: int,
                           num_branches: int):
    """-> tokens [b, k, gamma], q [b, k, gamma, v], state of the branches [b k]: a greedy
    token tree (branch j starts with the draft's j-th most likely token). Only where
    `proposes_top_branches`."""
    raise NotImplementedError(f'{type(self).__name__} proposes no token tree '
                              '(proposes_top_branches is False)')

  def load_params(self, sources: DraftSources):
    """The params pytree `propose` takes, from what a launcher has. Default: none."""
    del sources
    return ()

  def catch_up(self, params, state, context: DraftContext, window: int):
    """The state once the drafter has read the inputs x_{length-window}..x_{length-1}
    of `context` (those before 0 skipped), so that its next proposal reads no input it
    has not seen. A drafter proposing inside a StagedDrafter sees only some of the drafts
    the target then accepts; the staged drafter calls this before each proposal.
    Default: the state unchanged (drafters that read the context's tokens directly)."""
    del params, context, window
    return state

  def observe_target_features(self, params, state, features, start):
    """The state once it has the target's final hidden states features [b, k, e] (then
    the outputs of target_feature_layers: [b, k, e (1 + n)]) of the verify step just run,
    at positions start[b] + 0..k-1 (start: the committed length that step verified from).
    Only where `reads_target_features`. Default: unchanged."""
    del params, features, start
    return state

  def stats(self, state):
    """What the drafter counted over a decode, from its final state (a pytree, e.g. a
    StagedDrafter's StageStats), or None. Default: None."""
    del state
    return None


def draft_confidence(logits, probs, sampling: SamplingConfig):
  """[b]: the largest probability the draft gave at a position, from its logits [b, v]
  and standardized q [b, v]: max q when sampling; at temperature 0, where q is one-hot,
  the largest probability of the softmax of the logits."""
  if sampling.is_greedy:
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
  return jnp.max(probs, axis=-1)


def draw_tokens(keys, probs, sampling: SamplingConfig):
  """keys [b], probs [b, v] -> tokens [b] (argmax of a one-hot when greedy)."""
  if sampling.is_greedy:
    return argmax(probs)
  return jax.vmap(sample_probs)(keys, probs)

"""Speculative beam search: the target-only beam search's output, with fewer target calls.

The paper's Appendix A.4 sketches it; this is the exact form. Each iteration, with w
live target beams at step `cur` (the roots):
  1. draft: the draft T5 runs its own beam search of width u >= w for gamma steps
     from the roots (the roots' target log-probs plus the draft's, EOS never kept
     live), giving a tree: depth j holds u nodes, each a root and j drafted tokens;
  2. verify: every node becomes one row of ONE target decode call, its root's token
     x_cur followed by its path (padded with 0 to gamma tokens), from its root's cache
     gathered by row; the call returns the target's logits after every prefix of every
     row, [b, w + gamma * u, gamma + 1, v];
  3. accept: target beam search (beam_search.beam_step, the very function the plain
     search runs) is replayed on those logits, step after step, as long as T5X's loop
     condition holds and every live target beam, a root plus the tokens it appended
     this iteration, is the prefix of some row: that row's logits at that depth are the
     target's logits for exactly that beam. Step 0 always runs (the roots are rows), so
     every call advances 1 to gamma + 1 steps;
  4. the live beams' target caches are gathered from the rows they were matched to
     (the verify wrote their tokens' keys/values there) and their draft caches from
     their roots; both are rolled back by index.

The whole batch advances in lockstep, as T5X's beam search does (one step counter, one
loop condition over the batch): an iteration runs the steps every row can take. The
output is therefore beam_search's, token for token, for any draft; scores are the same
sums of the same log-softmax terms, with the target's logits computed by a decode over
gamma + 1 positions instead of one (equal up to float rounding of the matmuls).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec import validation
from jaxspec.errors import InvalidSetting
from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding import beam_search as bs
from jaxspec.model import T5, DecoderCache, rollback
from jaxspec.model.sharding import DRAFT, TARGET


@dataclasses.dataclass(frozen=True)
class SpeculativeBeamConfig:
  """Static settings of speculative beam search."""
  # Draft beam-search steps per target call; 'auto': chosen by measurement, 0 (plain beam
  # search) included (jaxspec.decoding.auto_gamma.AutoBeamDecoder, as the launcher does).
  gamma: int | str = 3
  draft_beams: int = 0  # u, the draft's beam width (>= num_beams); 0: 2 * num_beams.

  def __post_init__(self):
    validation.check_gamma_setting('jaxspec.SpeculativeBeamConfig.gamma', self.gamma)
    if self.draft_beams < 0:
      raise InvalidSetting(f'draft_beams must be >= 0 (0: twice the beams), got '
                           f'{self.draft_beams}')

  def draft_width(self, num_beams: int) -> int:
    return self.draft_beams or 2 * num_beams


@flax.struct.dataclass
class SpeculativeBeamStats:
  target_calls: jax.Array  # [] target decode calls (one per iteration)
  draft_calls: jax.Array  # [] draft decode calls
  steps_per_call: jax.Array  # [gamma + 2] iterations that advanced n = 0..gamma+1 steps

  @property
  def steps(self):
    """Beam search steps taken, the target calls plain beam search would make."""
    return jnp.sum(self.steps_per_call * jnp.arange(self.steps_per_call.shape[0]))

  @property
  def steps_per_target_call(self):
    return self.steps / jnp.maximum(self.target_calls, 1)


@flax.struct.dataclass
class SpeculativeBeamOutput:
  output: bs.BeamOutput
  stats: SpeculativeBeamStats


@flax.struct.dataclass
class _LoopState:
  beam: bs.BeamState
  target_cache: DecoderCache  # [b * w] rows, positions < beam.cur_index
  draft_cache: DecoderCache  # [b * w] rows, positions < draft_end
  draft_end: jax.Array  # [] int32
  stats: SpeculativeBeamStats


@flax.struct.dataclass
class _DraftTree:
  roots: jax.Array  # [b, R] int32, the live beam each node extends (R = w + gamma * u)
  paths: jax.Array  # [b, R, gamma] int32, its drafted tokens, 0 past its depth
  root_cache: DecoderCache  # [b * w] the draft caches of the roots, positions <= cur


def _gather_rows(cache, indices):
  """cache leaves [b * n, ...], indices [b, k] (into each item's n rows) -> [b * k, ...]."""
  batch, count = indices.shape

  def gather(x):
    x = x.reshape((batch, -1) + x.shape[1:])
    return bs._gather(x, indices).reshape((batch * count,) + x.shape[2:])
  return jax.tree_util.tree_map(gather, cache)


def _flat(x):  # [b, k, ...] -> [b * k, ...]
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _draft_tree(state: _LoopState, draft_params, *, draft_config: T5Config, gamma: int,
                draft_width: int, eos_id: int) -> _DraftTree:
  """The draft's beam search of width u for gamma steps from the live beams."""
  beam = state.beam
  batch, beams = beam.live_logprobs.shape
  cur = beam.cur_index
  model = T5(draft_config, role=DRAFT)
  # Catch up: the draft cache holds positions < draft_end; feed the live tokens from
  # there (at most gamma + 1 of them) and read the logits after x_cur.
  padded_seqs = jnp.pad(beam.live_seqs, ((0, 0), (0, 0), (0, gamma + 1)))
  window = jax.lax.dynamic_slice_in_dim(padded_seqs, state.draft_end, gamma + 1, axis=2)
  cache = rollback(state.draft_cache, jnp.full((batch * beams,), state.draft_end))
  logits, cache = model.apply(draft_params, _flat(window), cache, method=T5.decode)
  root_logits = jax.lax.dynamic_index_in_dim(logits, cur - state.draft_end, axis=1,
                                             keepdims=False)  # [b * w, v]
  root_cache = rollback(cache, jnp.full((batch * beams,), cur + 1))

  extra = draft_width - beams  # Empty draft beams (-inf) beside the roots.
  scores = jnp.pad(beam.live_logprobs, ((0, 0), (0, extra)), constant_values=-jnp.inf)
  roots = jnp.broadcast_to(jnp.pad(jnp.arange(beams), (0, extra)), (batch, draft_width))
  log_probs = jax.nn.log_softmax(root_logits.reshape(batch, beams, -1))
  log_probs = jnp.pad(log_probs, ((0, 0), (0, extra), (0, 0)))  # [b, u, v]
  paths = jnp.zeros((batch, draft_width, gamma), jnp.int32)

  def select(scores, log_probs, roots, paths, depth):
    """The u best one-token extensions without EOS (live beams never end in EOS)."""
    candidates = (scores[:, :, None] + log_probs).at[:, :, eos_id].set(-jnp.inf)
    vocab = candidates.shape[-1]
    scores, flat_indices = jax.lax.top_k(candidates.reshape(batch, -1), draft_width)
    parents, tokens = flat_indices // vocab, flat_indices % vocab  # [b, u]
    paths = jnp.where(jnp.arange(gamma) == depth, tokens[:, :, None],
                      bs._gather(paths, parents))
    return scores, bs._gather(roots, parents), paths, parents, tokens

  def draft_step(carry, depth):
    scores, log_probs, roots, paths, cache = carry
    scores, roots, paths, parents, tokens = select(scores, log_probs, roots, paths, depth)
    cache = _gather_rows(cache, parents)
    logits, cache = model.apply(draft_params, _flat(tokens[:, :, None]), cache,
                                method=T5.decode)  # [b * u, 1, v]
    log_probs = jax.nn.log_softmax(logits[:, 0].reshape(batch, draft_width, -1))
    return (scores, log_probs, roots, paths, cache), (roots, paths)

  beam_cache = _gather_rows(root_cache, roots)  # [b * u]
  carry, (scan_roots, scan_paths) = jax.lax.scan(
      draft_step, (scores, log_probs, roots, paths, beam_cache), jnp.arange(gamma - 1))
  scores, log_probs, roots, paths, _ = carry
  _, last_roots, last_paths, _, _ = select(scores, log_probs, roots, paths, gamma - 1)
  # Nodes: the roots (depth 0), then depths 1..gamma-1 from the scan, then depth gamma.
  node_roots = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(beams), (batch, beams)),
       jnp.moveaxis(scan_roots, 0, 1).reshape(batch, -1), last_roots], axis=1)
  node_paths = jnp.concatenate(
      [jnp.zeros((batch, beams, gamma), jnp.int32),
       jnp.moveaxis(scan_paths, 0, 1).reshape(batch, -1, gamma), last_paths], axis=1)
  return _DraftTree(roots=node_roots, paths=node_paths, root_cache=root_cache)


def _accept(beam: bs.BeamState, logits, tree: _DraftTree, *, gamma: int, eos_id: int,
            alpha: float, keep_going):
  """Replays target beam search over the verify logits [b, R, gamma + 1, v].

  Returns (new BeamState, the row each live beam's cache comes from [b, w], each live
  beam's root [b, w], steps taken).
  """
  batch, beams = beam.live_logprobs.shape
  no_forced_tokens = jnp.zeros((batch,), jnp.int32)

  def step(depth, carry):
    state, roots, paths, rows, going, steps = carry
    # A live beam has target logits if a row starts with its root and its tokens.
    in_prefix = jnp.arange(gamma) < depth  # [g]
    same_tokens = (paths[:, :, None, :gamma] == tree.paths[:, None, :, :]) | ~in_prefix
    matches = ((roots[:, :, None] == tree.roots[:, None, :])
               & jnp.all(same_tokens, axis=-1))  # [b, w, R]
    matched_rows = jnp.argmax(matches, axis=-1)  # [b, w]
    go = going & jnp.all(jnp.any(matches, axis=-1)) & keep_going(state)
    depth_logits = jax.lax.dynamic_index_in_dim(logits, depth, axis=2, keepdims=False)
    new_state, parents = bs.beam_step(state, bs._gather(depth_logits, matched_rows),
                                      no_forced_tokens, eos_id=eos_id, alpha=alpha)
    new_tokens = jax.lax.dynamic_index_in_dim(new_state.live_seqs, new_state.cur_index,
                                              axis=2, keepdims=False)  # [b, w]
    new_paths = jnp.where(jnp.arange(gamma + 1) == depth, new_tokens[:, :, None],
                          bs._gather(paths, parents))
    advanced = (new_state, bs._gather(roots, parents), new_paths,
                bs._gather(matched_rows, parents))
    kept = (state, roots, paths, rows)
    state, roots, paths, rows = jax.tree_util.tree_map(
        lambda new, old: jnp.where(go, new, old), advanced, kept)
    return state, roots, paths, rows, go, steps + go.astype(jnp.int32)

  initial = (beam, jnp.broadcast_to(jnp.arange(beams), (batch, beams)),
             jnp.zeros((batch, beams, gamma + 1), jnp.int32),
             jnp.broadcast_to(jnp.arange(beams), (batch, beams)), jnp.array(True),
             jnp.zeros((), jnp.int32))
  state, roots, _, rows, _, steps = jax.lax.fori_loop(0, gamma + 1, step, initial)
  return state, rows, roots, steps


def _iteration(state: _LoopState, target_params, draft_params, *, target_config: T5Config,
               draft_config: T5Config, beam: bs.BeamConfig, spec: SpeculativeBeamConfig,
               eos_id: int, keep_going) -> _LoopState:
  gamma = spec.gamma
  batch, beams = state.beam.live_logprobs.shape
  cur = state.beam.cur_index
  tree = _draft_tree(state, draft_params, draft_config=draft_config, gamma=gamma,
                     draft_width=spec.draft_width(beam.num_beams), eos_id=eos_id)
  # Verify: one decode over every node's row, each from its root's cache.
  pending = jax.lax.dynamic_index_in_dim(state.beam.live_seqs, cur, axis=2,
                                         keepdims=False)  # [b, w]
  verify_tokens = jnp.concatenate(
      [bs._gather(pending, tree.roots)[:, :, None], tree.paths], axis=2)  # [b, R, g+1]
  rows = tree.roots.shape[1]
  target_cache = _gather_rows(state.target_cache, tree.roots)
  logits, target_cache = T5(target_config, role=TARGET).apply(
      target_params, _flat(verify_tokens), target_cache, method=T5.decode)
  logits = logits.reshape(batch, rows, gamma + 1, -1)
  new_beam, cache_rows, roots, steps = _accept(state.beam, logits, tree, gamma=gamma,
                                               eos_id=eos_id, alpha=beam.alpha,
                                               keep_going=keep_going)
  row_count = jnp.full((batch * beams,), new_beam.cur_index)
  stats = state.stats
  stats = stats.replace(
      target_calls=stats.target_calls + 1, draft_calls=stats.draft_calls + gamma,
      steps_per_call=stats.steps_per_call + jax.nn.one_hot(steps, gamma + 2, dtype=jnp.int32))
  return _LoopState(
      beam=new_beam,
      target_cache=rollback(_gather_rows(target_cache, cache_rows), row_count),
      draft_cache=_gather_rows(tree.root_cache, roots), draft_end=cur + 1, stats=stats)


def speculative_beam_generate(target_params, draft_params, encoder_tokens, *,
                              target_config: T5Config, draft_config: T5Config,
                              beam: bs.BeamConfig, spec: SpeculativeBeamConfig,
                              max_decode_length: int,
                              eos_id: int = EOS_ID) -> SpeculativeBeamOutput:
  """Beam search over encoder_tokens [b, s] with the target, a draft T5 proposing.

  Output: generate_beam's (tokens [b, beams, max_decode_length] best last, scores
  [b, beams]) for any draft; stats count target calls and steps per call. One jit.
  """
  if draft_config.vocab_size != target_config.vocab_size:
    raise ValueError(
        f'draft and target vocabularies differ: the draft has vocab_size '
        f'{draft_config.vocab_size}, the target {target_config.vocab_size}')
  if spec.gamma == validation.AUTO_GAMMA:
    raise ValueError("speculative_beam_generate takes an integer gamma; gamma='auto' is "
                     'chosen by jaxspec.decoding.auto_gamma.AutoBeamDecoder (as the '
                     'launcher does)')
  validation.check_encoder_tokens(encoder_tokens, target_config.vocab_size)
  validation.check_decode_positions(target_config, spec.gamma + 1)
  bs.check_beam_settings(beam, max_decode_length)
  if spec.draft_width(beam.num_beams) < beam.num_beams:
    raise ValueError(f'draft_beams ({spec.draft_beams}) must be >= num_beams '
                     f'({beam.num_beams}): the draft proposes at least the target\'s beams')
  return _speculative_beam_generate(
      target_params, draft_params, encoder_tokens, target_config=target_config,
      draft_config=draft_config, beam=beam, spec=spec, max_decode_length=max_decode_length,
      eos_id=eos_id)


@functools.partial(jax.jit, static_argnames=('target_config', 'draft_config', 'beam', 'spec',
                                             'max_decode_length', 'eos_id'))
def _speculative_beam_generate(target_params, draft_params, encoder_tokens, *,
                               target_config: T5Config, draft_config: T5Config,
                               beam: bs.BeamConfig, spec: SpeculativeBeamConfig,
                               max_decode_length: int, eos_id: int) -> SpeculativeBeamOutput:
  batch, beams = encoder_tokens.shape[0], beam.num_beams
  # Room for a full verify window even from the last position.
  cache_length = max_decode_length + spec.gamma

  def expanded_cache(params, config, role):
    cache = bs.t5_beam_cache(params, encoder_tokens, config=config, max_length=cache_length,
                             role=role)
    return jax.tree_util.tree_map(lambda x: jnp.repeat(x, beams, axis=0), cache)

  keep_going = functools.partial(bs.should_continue, alpha=beam.alpha,
                                 max_decode_len=max_decode_length,
                                 max_decode_step=beam.max_decode_step,
                                 min_log_prob=beam.min_log_prob)
  initial = _LoopState(
      beam=bs.init_state(batch, beams, max_decode_length),
      target_cache=expanded_cache(target_params, target_config, TARGET),
      draft_cache=expanded_cache(draft_params, draft_config, DRAFT),
      draft_end=jnp.zeros((), jnp.int32),
      stats=SpeculativeBeamStats(
          target_calls=jnp.zeros((), jnp.int32), draft_calls=jnp.zeros((), jnp.int32),
          steps_per_call=jnp.zeros((spec.gamma + 2,), jnp.int32)))
  body = functools.partial(
      _iteration, target_params=target_params, draft_params=draft_params,
      target_config=target_config, draft_config=draft_config, beam=beam, spec=spec,
      eos_id=eos_id, keep_going=keep_going)
  final = jax.lax.while_loop(lambda s: keep_going(s.beam), body, initial)
  tokens, scores = bs.final_output(final.beam)
  return SpeculativeBeamOutput(
      output=bs.BeamOutput(tokens=tokens, scores=scores, steps=final.beam.cur_index),
      stats=final.stats)

"""Multi-draft verification: k drafts per row, verified in ONE target decode step.

SpeculativeConfig.num_drafts = k > 1. Each iteration, for every row:
  1. k branches of gamma drafts. Sampling: k i.i.d. proposals of the drafter (its state
     and context repeated k times along the batch, one key per branch). Temperature 0:
     a token tree, branch j starting with the draft's j-th most likely token after
     x_length and continuing greedily (drafters with `propose_top_branches`).
  2. The target decodes the tree [x_length, branch 0, ..., branch k-1] (1 + k * gamma
     tokens, `tree_layout`) in one step: node (j, i) at flat index 1 + j * gamma + i
     sits at position length + i + 1 (its depth), and attends to the cache, the root
     and the earlier tokens of its own branch (jaxspec.model.DecodeTree).
  3. The verdict (`multi_draft_verdict`, or `greedy_tree_verdict` at temperature 0)
     picks a branch and its accepted prefix n plus the next token.
  4. `compact_branch` moves that branch's keys/values to the slots right after the
     root, so the cache reads as if the accepted tokens had been decoded in sequence;
     the drafter state of the chosen branch becomes the row's state
     (`select_branch_state`).

Why `multi_draft_verdict` is exact (recursive rejection sampling, SpecInfer / SpecTr).
Write p for the target's standardized distribution at the accepted prefix, q the
drafter's. One depth with m candidates x_1..x_m drawn i.i.d. from q:
  try x_1: accept with probability min(1, p(x_1) / q(x_1)); on rejection replace p by
  p' = norm(max(p - q, 0)) and try x_2 against p', ...; if all m are rejected, draw
  from the last residual.
Claim: the token output has distribution p. By induction on m: for m = 0 it is a
draw from p. For m >= 1, P(x_1 accepted and equal to y) = q(y) min(1, p(y)/q(y)) =
min(p(y), q(y)), and P(reject) = 1 - sum_y min(p, q) = sum_y max(p - q, 0) = r. Given a
rejection, x_2..x_m are still i.i.d. from q (independent of x_1 and its uniform), so by
induction the rest outputs p' = max(p - q, 0) / r. In total
min(p(y), q(y)) + r p'(y) = min(p, q) + max(p - q, 0) = p(y).
Across depths: the branches whose tokens so far equal the accepted prefix (there is at
least one, the one just accepted) have next tokens that are i.i.d. draws from
q(. | prefix): each branch is an independent autoregressive sample, and everything the
verdict has looked at so far (tokens at smaller depths, their uniforms) is independent
of those next tokens given the prefix. So each depth is again the m-candidate case,
with p the target's conditional at the accepted prefix: every accepted token and the
token drawn at the stop (from the residual after a rejection of every candidate, or the
bonus from p after a fully accepted branch) come from the target's conditional, which
is the target's joint distribution token by token, as in Algorithm 1 (k = 1 is
exactly Algorithm 1). Duplicate branches (likely with a peaked q) are fine: a repeated
candidate is just another i.i.d. draw, tried against the current residual.

At temperature 0 p is one-hot at the target's argmax t: a candidate is accepted iff it
equals t, and the residual after rejecting x != t is p again. So the verdict accepts
the longest branch prefix that equals the target's argmax path, then emits t; any
set of branches keeps the output the baseline's, whence the top-k token tree.

Shape letters: b batch, k drafts (branches), g gamma, t = 1 + k g tree tokens, v vocab.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.decoding.drafters.base import DraftContext, Drafter
from jaxspec.decoding.verification.rule import VerificationRule
from jaxspec.decoding.verification.token import (acceptance_probability, acceptance_rate,
                                                 residual_distribution)
from jaxspec.model import DecodeTree, DecoderCache
from jaxspec.sampling import SamplingConfig, argmax, gather_probs, sample_probs

# A tree is judged token-wise (exact), every branch of the fixed gamma, in one step of
# 1 + k * gamma positions: no lenience, adaptive gamma or shorter verify steps.
RULE = VerificationRule(name='tree', exact_only=True, adaptive_gamma=False,
                        multi_draft=True, verify_lengths=False)


def tree_layout(num_drafts: int, gamma: int) -> DecodeTree:
  """The DecodeTree of [root, branch 0 (g tokens), ..., branch k-1].

  Flat index 0 is the root (depth 0); 1 + j g + i is token i of branch j (depth i + 1).
  Each token sees the root and the tokens of its own branch up to itself.
  """
  flat = jnp.arange(1 + num_drafts * gamma)  # [t]
  branch = jnp.where(flat == 0, -1, (flat - 1) // gamma)  # [t], -1 at the root
  depths = jnp.where(flat == 0, 0, (flat - 1) % gamma + 1)  # [t]
  same_branch = branch[:, None] == branch[None, :]  # [t, t]
  ancestors = (flat[None, :] == 0) | (same_branch & (depths[None, :] <= depths[:, None]))
  return DecodeTree(depths=depths.astype(jnp.int32), ancestors=ancestors)


def flatten_tree(root, drafts):
  """root [b, 1] (x_length), drafts [b, k, g] -> the tree's tokens [b, 1 + k g]."""
  return jnp.concatenate([root, drafts.reshape(drafts.shape[0], -1)], axis=1)


def path_nodes(num_drafts: int, gamma: int):
  """[k, g+1] flat indices of the nodes whose logits score branch j: the root, then
  tokens 0..g-1 of the branch (the last gives the bonus distribution)."""
  depth = jnp.arange(gamma + 1)[None, :]  # [1, g+1]
  branch = jnp.arange(num_drafts)[:, None]  # [k, 1]
  return jnp.where(depth == 0, 0, 1 + branch * gamma + depth - 1)


def branch_values(tree_values, num_drafts: int, gamma: int):
  """tree_values [b, t, ...] (e.g. logits) -> [b, k, g+1, ...] along each branch's path."""
  nodes = path_nodes(num_drafts, gamma)  # [k, g+1]
  return tree_values[:, nodes]


def select_branch(values, branch):
  """values [b, k, ...], branch [b] -> values[row, branch[row]] [b, ...]."""
  return values[jnp.arange(values.shape[0]), branch]


def _repeat(tree, repeats: int):
  """Every leaf repeated `repeats` times along its leading (batch) axis."""
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, repeats, axis=0), tree)


def propose_branches(drafter: Drafter, params, state, context: DraftContext, gamma: int,
                     num_drafts: int, sampling: SamplingConfig, keys):
  """k i.i.d. proposals per row: -> drafts [b, k, g], q [b, k, g, v], state [b k].

  The drafter runs once on the rows repeated k times (state, context), branch j of row
  b with key split(keys[b], k)[j]. Every leaf of the drafter state must lead with the
  batch axis (T5 caches do; stateless drafters have no leaves).
  """
  batch = context.length.shape[0]
  branch_keys = jax.vmap(lambda key: jax.random.split(key, num_drafts))(keys)  # [b, k]
  drafts, probs, branch_state = drafter.propose(
      params, _repeat(state, num_drafts), _repeat(context, num_drafts), gamma, sampling,
      branch_keys.reshape((batch * num_drafts,) + branch_keys.shape[2:]))
  return (drafts.reshape(batch, num_drafts, gamma),
          probs.reshape(batch, num_drafts, gamma, -1), branch_state)


def propose_tree(drafter: Drafter, params, state, context: DraftContext, gamma: int,
                 num_drafts: int, sampling: SamplingConfig, keys):
  """The k branches of one iteration: a greedy top-k token tree at temperature 0
  (drafter.propose_top_branches), i.i.d. proposals otherwise."""
  if sampling.is_greedy:
    return drafter.propose_top_branches(params, state, context, gamma, num_drafts)
  return propose_branches(drafter, params, state, context, gamma, num_drafts, sampling, keys)


def uses_tree(drafter: Drafter, num_drafts: int, sampling: SamplingConfig) -> bool:
  """Whether multi-draft verification runs: k > 1, and at temperature 0 a drafter that
  proposes a top-k tree (k i.i.d. greedy drafts would be k copies of one draft, so
  other drafters decode as with k = 1, which gives the same output)."""
  return num_drafts > 1 and (not sampling.is_greedy or drafter.proposes_top_branches)


def select_branch_state(branch_state, branch, num_drafts: int):
  """branch_state [b k, ...] leaves, branch [b] -> the chosen branch's state [b, ...]."""
  def select(x):
    return select_branch(x.reshape((-1, num_drafts) + x.shape[1:]), branch)
  return jax.tree_util.tree_map(select, branch_state)


@flax.struct.dataclass
class MultiDraftVerdict:
  """The outcome of one multi-draft verification, per row."""
  branch: jax.Array  # [b] int32, the branch whose first num_accepted drafts are accepted
  num_accepted: jax.Array  # [b] int32 in 0..g
  next_token: jax.Array  # [b] int32, drawn at the stop (residual) or the bonus token
  # [b, g] float32, sum_x min(p, q) at each depth for the first branch still matching
  # the accepted prefix: single-draft beta (Theorem 3.5), comparable across k.
  overlap: jax.Array


def _first_true(mask):
  """mask [b, k] bool -> [b] int32 index of the first True (0 if none)."""
  return jnp.argmax(mask, axis=1).astype(jnp.int32)


def _try_candidates(probs, candidates, candidate_probs, tried, uniforms):
  """One depth of recursive rejection sampling.

  probs [b, v] the target's p; candidates [b, k] tokens with the q they were drawn from
  [b, k, v]; tried [b, k] which candidates take part (in order); uniforms [b, k].
  -> (found [b] bool, accepted token [b], the residual after the rejections [b, v]).
  """
  batch, num_drafts = candidates.shape
  found = jnp.zeros((batch,), bool)
  token = jnp.zeros((batch,), jnp.int32)
  for j in range(num_drafts):
    x, q = candidates[:, j], candidate_probs[:, j]  # [b], [b, v]
    takes_part = tried[:, j] & ~found
    accept_prob = acceptance_probability(probs[:, None], q[:, None], x[:, None])[:, 0]
    accepted = takes_part & (uniforms[:, j] < accept_prob)
    rejected = takes_part & ~accepted
    probs = jnp.where(rejected[:, None], residual_distribution(probs, q), probs)
    token = jnp.where(accepted, x, token)
    found = found | accepted
  return found, token, probs


def multi_draft_verdict(keys, drafts, draft_probs, target_probs) -> MultiDraftVerdict:
  """Recursive rejection sampling over k i.i.d. branches (module docstring: why exact).

  keys [b]; drafts [b, k, g]; q [b, k, g, v] recorded at draft time; target_probs
  [b, k, g+1, v], the target's p along each branch (branch_values of the tree step).
  At depth d the branches matching the accepted prefix ("alive") are tried in order
  of index; the next depth continues with those whose depth-d token is the accepted one.
  """
  batch, num_drafts, gamma = drafts.shape
  rows = jnp.arange(batch)
  row_keys = jax.vmap(lambda key: jax.random.split(key, 2))(keys)  # [b, 2]
  uniforms = jax.vmap(lambda key: jax.random.uniform(key, (gamma, num_drafts)))(
      row_keys[:, 0])  # [b, g, k]
  alive = jnp.ones((batch, num_drafts), bool)
  searching = jnp.ones((batch,), bool)  # No depth has rejected every candidate yet.
  num_accepted = jnp.zeros((batch,), jnp.int32)
  final_probs = jnp.zeros(target_probs.shape[:1] + target_probs.shape[3:], jnp.float32)
  overlaps = []
  for depth in range(gamma):
    # [b]; alive branches share the prefix, hence p. (At depth 0 all are alive.)
    current = _first_true(alive) if depth else jnp.zeros((batch,), jnp.int32)
    probs = target_probs[rows, current, depth]  # [b, v]
    overlaps.append(acceptance_rate(probs, draft_probs[rows, current, depth]))
    found, token, residual = _try_candidates(
        probs, drafts[:, :, depth], draft_probs[:, :, depth], alive & searching[:, None],
        uniforms[:, depth])
    final_probs = jnp.where((searching & ~found)[:, None], residual, final_probs)
    alive = jnp.where(found[:, None], alive & (drafts[:, :, depth] == token[:, None]), alive)
    num_accepted = num_accepted + found.astype(jnp.int32)
    searching = searching & found
  branch = _first_true(alive)
  final_probs = jnp.where(searching[:, None], target_probs[rows, branch, gamma], final_probs)
  next_token = jax.vmap(sample_probs)(row_keys[:, 1], final_probs)
  return MultiDraftVerdict(branch=branch, num_accepted=num_accepted, next_token=next_token,
                           overlap=jnp.stack(overlaps, axis=1))


def greedy_tree_verdict(drafts, draft_probs, target_logits) -> MultiDraftVerdict:
  """multi_draft_verdict at temperature 0, from the target's argmax alone.

  drafts [b, k, g]; q [b, k, g, v]; target_logits [b, k, g+1, v] along each branch.
  Accepts the longest branch prefix equal to the target's argmax path (the first such
  branch on ties) and emits the target's argmax after it.
  """
  batch, num_drafts, gamma = drafts.shape
  rows = jnp.arange(batch)
  target_tokens = argmax(target_logits)  # [b, k, g+1]
  matches = drafts == target_tokens[:, :, :gamma]  # [b, k, g]
  run = jnp.sum(jnp.cumprod(matches, axis=2), axis=2).astype(jnp.int32)  # [b, k]
  branch = jnp.argmax(run, axis=1).astype(jnp.int32)  # [b]
  num_accepted = run[rows, branch]
  next_token = target_tokens[rows, branch, num_accepted]
  # The first branch alive at each depth, as multi_draft_verdict: q(t) there.
  alive = run[:, :, None] >= jnp.arange(gamma)[None, None, :]  # [b, k, g]
  current = jnp.argmax(alive, axis=1)  # [b, g]
  depths = jnp.arange(gamma)[None, :]
  overlap = gather_probs(draft_probs[rows[:, None], current, depths],
                         target_tokens[rows[:, None], current, depths])  # [b, g]
  return MultiDraftVerdict(branch=branch, num_accepted=num_accepted, next_token=next_token,
                           overlap=overlap)


def compact_branch(cache: DecoderCache, root_slot, branch, gamma: int) -> DecoderCache:
  """Moves branch `branch` [b]'s keys/values next to the root.

  After the tree step at end_index = root_slot [b], token i of branch j sits at slot
  root_slot + 1 + j g + i; this copies slots of the chosen branch to root_slot + 1 + i
  (a gather, then a scatter over the new slots only, per layer). With the cache rolled
  back to root_slot + 1 + n, it holds exactly the root and the n accepted tokens in
  sequence. end_index is left as it is.
  """
  rows = jnp.arange(cache.batch_size)[:, None]  # [b, 1]
  depths = jnp.arange(gamma)[None, :]  # [1, g]
  source = root_slot[:, None] + 1 + branch[:, None] * gamma + depths  # [b, g]
  target = root_slot[:, None] + 1 + depths  # [b, g]
  source = jnp.clip(source, 0, cache.max_length - 1)

  def move(buffer):  # [b, h, d, L]; buffer[rows, :, :, slots] is [b, g, h, d]
    return buffer.at[rows, :, :, target].set(buffer[rows, :, :, source], mode='drop')

  return cache.replace(layers=tuple(
      layer.replace(self_keys=move(layer.self_keys), self_values=move(layer.self_values))
      for layer in cache.layers))


def path_of(values, branch):
  """values [b, k, ...] along each branch -> the chosen branch's [b, ...] (None: None)."""
  return None if values is None else select_branch(values, branch)


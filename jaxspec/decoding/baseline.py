"""The baseline decoder: T5X's temperature sampling, one token per step.

`temperature_sample` is T5X's `decoding.temperature_sample` (google-research/t5x
`t5x/decoding.py`): the same arguments, the same loop state (`SamplingLoopState`,
`DecodingState`, T5X's field names and shapes) and the same results, in T5X's structure
(`temperature_sample` repeats the inputs and the cache through `cache_map` and calls
`_temperature_sample_single_trial` on the flattened batch), so T5X's mocks of those
apply. Given T5X's one key it draws T5X's tokens, bit for bit: `jax.random.split` of the
loop key every step and `jax.random.categorical`'s draw over the whole flattened batch,
both looked up on jax.random when called, as T5X does, so a user's mock of either
applies (`_t5x_categorical`; unmocked, the same values come from `sampling.categorical`).
Prompts are forced tokens (non-zero inputs), `initial_index` starts rows at uneven
prompt lengths after a prefilled cache, temperature / topk / topp may be traced or per
input row, callbacks see and edit the loop state, `num_decodes` flattens the batch as
[batch * num_decodes] (each input's copies adjacent) in the inputs and the cache. Places
where T5X's behaviour looks unintended are matched and marked "T5X quirk" below.

jaxspec extension: `decode_rng` may hold one key per decoded row
([batch * num_decodes]); row r then samples step i with fold_in(key_r, i), so its
samples never depend on the other rows (what `generate` does), drawn by
`sampling.categorical` (jax.random.categorical's draw with jaxspec.prng's unrolled
threefry, faster on CPU). T5X accepts one key.

`generate` runs jaxspec's own loop on a jaxspec T5: encode once, cross-attention
keys/values cached once, one cached decode step per token, all inside one `jax.jit`.
`prefill_decoder_prompt` feeds decoder prompts of uneven lengths into a jaxspec cache
in ONE multi-position decode step, for `temperature_sample(..., initial_index=...)`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.core
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import validation
from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding import common
from jaxspec.model import T5, rollback
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.sampling import (MIN_TEMPERATURE, SamplingConfig, argmax, categorical,
                              nonfinite_logits, sample_logits, token_log_probs)

# jax.random.categorical as JAX defines it, taken when jaxspec is imported.
_JAX_CATEGORICAL = jax.random.categorical

# T5X's constants: masked logits are set to -1e7; the temperature floor is a float64
# numpy scalar there, which fixes how the division below rounds and promotes.
T5X_NEG_INF = np.array(-1.0e7)
_MIN_TEMPERATURE = np.array(MIN_TEMPERATURE)
# Cache leaves T5X never repeats for num_decodes (t5x decoding.cache_map): the
# relative-position bias and absolute position index, and `cache_index` unless the
# cache was prefilled (initial_index given), where it is per row.
_SHARED_CACHE_LEAVES = ('cached_bias', 'position_embedder_index')


@flax.struct.dataclass
class DecodingState:
  """What `tokens_to_logits` sees each step (T5X's fields; r = batch * num_decodes)."""
  cur_index: jax.Array  # [r] int32, position of cur_token in `sequences`
  sequences: jax.Array  # [r, L] int32, start token at position 0
  cur_token: jax.Array  # [r, 1] int32
  cache: Any


@flax.struct.dataclass
class SamplingLoopState:
  """The loop state callbacks see and may edit (T5X's fields, order and shapes)."""
  step: jax.Array  # [] int32, iterations run
  cur_index: jax.Array  # [r] int32, position of cur_token in `sequences`
  # [r, L + 2]: start token, the L output positions (non-zero inputs are forced), and a
  # garbage slot that rows past their end overwrite until every row has ended.
  sequences: jax.Array
  cache: Any
  cur_token: jax.Array  # [r, 1] int32
  ended: jax.Array  # [r, 1] bool
  rng: jax.Array  # one PRNG key, split every step (or [r] per-row keys, kept)
  log_prob: jax.Array  # [r] float32, sum of the generated tokens' log-probs


def _is_tracer(value) -> bool:
  return isinstance(value, jax.core.Tracer)


def _per_row(value, name: str, batch: int, num_decodes: int):
  """A scalar setting or one per input row [batch] -> [] or [batch * num_decodes]."""
  value = jnp.asarray(value)
  if value.ndim == 0:
    return value
  if value.shape != (batch,):
    raise ValueError(f'{name} must be a scalar or one value per input row, shape '
                     f'({batch},); got shape {value.shape}')
  return jnp.repeat(value, num_decodes)


def _is_nonzero(value) -> bool:
  """True if a setting is on: traced (unknown), or any value non-zero."""
  return _is_tracer(value) or bool(np.any(np.asarray(value) != 0))


def _top_k_mask(logits, topk):
  """logits [r, v] -> the same, below each row's k-th largest set to -1e7 (ties kept).

  topk: a Python int (k <= 0 or k >= v keep all), or an array [] / [r], maybe traced,
  where k <= 0 keeps all.
  """
  vocab = logits.shape[-1]
  if isinstance(topk, (int, np.integer)):
    if topk <= 0 or topk >= vocab:
      return logits
    kth_largest = jax.lax.top_k(logits, int(topk))[0][:, -1:]  # [r, 1]
    return jnp.where(logits >= kth_largest, logits, T5X_NEG_INF)
  k = jnp.broadcast_to(jnp.asarray(topk, jnp.int32), logits.shape[:1])  # [r]
  descending = -jnp.sort(-logits, axis=-1)  # [r, v]
  kth_largest = jnp.take_along_axis(descending, jnp.clip(k - 1, 0, vocab - 1)[:, None], -1)
  masked = jnp.where(logits >= kth_largest, logits, T5X_NEG_INF)
  return jnp.where((k > 0)[:, None], masked, logits)


def _top_p_mask(logits, topp):
  """logits [r, v] -> the same, keeping the tokens with prob >= t, where t is the largest
  cut whose kept mass is >= topp (the smallest such set, ties at the cut kept).

  topp: a number or an array [] / [r]. The kept mass is summed in descending order; T5X
  sums it by a binary search over the cut, so a cut within float rounding of topp could
  fall differently. T5X quirk: topp <= 0 (reachable when topp is traced) keeps no token,
  all logits become -1e7 and sampling is uniform; matched.
  """
  probs = jax.nn.softmax(logits, axis=-1)  # [r, v]
  descending = -jnp.sort(-probs, axis=-1)  # [r, v]
  mass = jnp.cumsum(descending, axis=-1)  # [r, v] mass of the i + 1 most likely
  topp = jnp.broadcast_to(jnp.asarray(topp, jnp.float32), logits.shape[:1])[:, None]  # [r, 1]
  reached = mass >= topp  # [r, v]
  cut = jnp.take_along_axis(descending, jnp.argmax(reached, axis=-1)[:, None], -1)  # [r, 1]
  cut = jnp.where(jnp.any(reached, axis=-1, keepdims=True), cut, -jnp.inf)  # never: keep all
  cut = jnp.where(topp <= 0, jnp.finfo(jnp.float32).max, cut)
  return jnp.where(probs >= cut, logits, T5X_NEG_INF)


def _t5x_categorical(key, logits):
  """T5X's draw, `random.categorical(key, logits).astype(int32)`: logits [r, v] -> [r].

  T5X looks `categorical` up on the jax.random module at every call (as it does `split`,
  which the loop here calls as T5X does), so a user's mock or wrapper of
  jax.random.categorical takes T5X's draws; then it is called here too, with T5X's
  arguments. While JAX's own function stands there (never mocked), its values are drawn
  by `sampling.categorical`: the same Gumbel noise from the key and the same
  first-largest pick, draw for draw, with jaxspec.prng's unrolled threefry and
  sampling.argmax (a draw over [8, 8000] logits ~2.7x faster on XLA:CPU).
  """
  if jax.random.categorical is _JAX_CATEGORICAL:
    return categorical(key, logits)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def _gather(log_probs, tokens):
  """log_probs [r, v], tokens [r] -> [r]."""
  return jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def _draw(logits, key, temperature, topk, topp, rescale_log_probs: bool, per_row_keys: bool):
  """One sampling step: (tokens [r] int32, their log-probs [r] float32).

  logits [r, v]; key: one key, or [r] keys when per_row_keys; temperature: a Python
  number, or an array [] or [r] (traced or not); topk / topp as `_top_k_mask` /
  `_top_p_mask` take them. At temperature <= MIN_TEMPERATURE: argmax, log-prob 0 when
  rescaled (T5X ignores topk/topp there).
  """
  greedy_tokens = argmax(logits)
  if rescale_log_probs:
    greedy_log_probs = jnp.zeros(greedy_tokens.shape, jnp.float32)
  else:
    greedy_log_probs = _gather(jax.nn.log_softmax(logits), greedy_tokens)
  static = isinstance(temperature, (int, float))
  if static and temperature <= MIN_TEMPERATURE:
    return greedy_tokens, greedy_log_probs

  temperature = jnp.asarray(temperature)
  divisor = jnp.maximum(temperature, _MIN_TEMPERATURE)
  scaled = logits / (divisor[:, None] if temperature.ndim else divisor)  # [r, v]
  if _is_nonzero(topk):
    scaled = _top_k_mask(scaled, topk)
  if _is_nonzero(topp):  # T5X: a traced topp is always applied, even when it is 0.
    scaled = _top_p_mask(scaled, topp)
  if per_row_keys:  # jaxspec's per-row keys (no T5X counterpart).
    tokens = jax.vmap(categorical)(key, scaled)
  elif temperature.ndim:
    # T5X quirk: with one temperature per row T5X samples each row on its own with the
    # SAME key, so rows with equal logits (the num_decodes copies of an input) draw
    # equal tokens. Matched: every row reuses `key` for a [1, v] draw, under vmap, by
    # jax.random.categorical itself (sampling.categorical drew token v, out of range,
    # for some rows of this form under XLA:CPU --xla_backend_optimization_level=0).
    tokens = jax.vmap(
        lambda row: jax.random.categorical(key, row[None]).astype(jnp.int32)[0])(scaled)
  else:
    tokens = _t5x_categorical(key, scaled)
  log_probs = _gather(jax.nn.log_softmax(scaled if rescale_log_probs else logits), tokens)
  if static:
    return tokens, log_probs
  sampled = temperature > MIN_TEMPERATURE  # [] or [r]
  return (jnp.where(sampled, tokens, greedy_tokens),
          jnp.where(sampled, log_probs, greedy_log_probs))


def _cache_leaf_name(path) -> str | None:
  last = path[-1] if path else None
  for attribute in ('key', 'name'):  # DictKey.key, GetAttrKey.name
    if hasattr(last, attribute):
      return str(getattr(last, attribute))
  return None


def cache_map(fn, cache, apply_to_index: bool = False):
  """T5X's `decoding.cache_map`: fn applied to every cache leaf but those T5X shares
  across decodes: `cached_bias`, `position_embedder_index`, and `cache_index` unless
  apply_to_index (a prefilled cache's per-row index). Leaves are named by their last
  path entry (a dict key or a dataclass field), so jaxspec's cache dataclasses work as
  T5X's nested dicts do; a FrozenDict stays frozen.
  """
  frozen = isinstance(cache, flax.core.FrozenDict)
  tree = flax.core.unfreeze(cache) if frozen else cache

  def apply(path, leaf):
    name = _cache_leaf_name(path)
    if name in _SHARED_CACHE_LEAVES or (name == 'cache_index' and not apply_to_index):
      return leaf
    return fn(leaf)

  mapped = jax.tree_util.tree_map_with_path(apply, tree)
  return flax.core.freeze(mapped) if frozen else mapped


def _repeat_rows(leaf, num_decodes: int, offset: int = 0):
  """[..., b, ...] (batch axis `offset`) -> [..., b * num_decodes, ...], each row's
  copies adjacent (T5X's flat_batch_beam_expand). Leaves without a batch axis
  (scalars) are returned as they are; T5X would fail on them."""
  if jnp.ndim(leaf) <= offset:
    return leaf
  return jnp.repeat(leaf, num_decodes, axis=offset)


def expand_cache(cache, num_decodes: int, cache_offset: int = 0, expand_index: bool = False):
  """Repeats every cache row num_decodes times in place ([b, ...] -> [b * n, ...]).

  The batch axis is `cache_offset` (1 for scanned layers, whose leaves lead with a
  layer axis). As T5X: leaves named `cached_bias` and `position_embedder_index` are
  shared, and `cache_index` too unless expand_index (a prefilled cache's per-row index).
  Leaves without a batch axis (scalars) are shared; T5X would fail on them.
  """
  return cache_map(functools.partial(_repeat_rows, num_decodes=num_decodes,
                                     offset=cache_offset),
                   cache, apply_to_index=expand_index)


def _is_single_key(rng) -> bool:
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return rng.ndim == 0
  return rng.ndim == 1


def _max_decode_lengths(inputs, max_decode_steps):
  """The last position each row may fill: L, or [r] prompt length + max_decode_steps."""
  length = inputs.shape[1]
  if max_decode_steps is None:
    return length
  if not _is_tracer(max_decode_steps) and np.any(np.asarray(max_decode_steps) > length):
    raise ValueError(f'max_decode_steps ({max_decode_steps}) exceeds the decode length '
                     f'{length} (inputs.shape[1])')
  # Counted after the prompt: the prompt's non-zero tokens plus max_decode_steps.
  # T5X quirk, matched: a row without prompt and max_decode_steps=0 still runs one step,
  # which writes a token at position 1 (its log-prob counted); if other rows go on, the
  # row, clamped, later overwrites that position with 0.
  return jnp.minimum(length, jnp.sum(inputs != 0, axis=1) + max_decode_steps).astype(jnp.int32)


def _sampling_loop(inputs, cache, tokens_to_logits, eos_id, rng, draw, initial_index,
                   max_decode_len, state_callback_fn, logit_callback_fn):
  """T5X's sampling loop over flattened rows: (sequences [r, L], log_prob [r]).

  inputs [r, L] int32 (0 = free position; position 0 is the start token unless
  initial_index [r] points into a prefilled prompt); draw(logits, key) -> (tokens,
  log-probs); max_decode_len: an int or [r].
  """
  rows, _ = inputs.shape
  per_row_keys = not _is_single_key(rng)
  sequences = jnp.pad(inputs, ((0, 0), (0, 2)))  # [r, L + 2]
  if initial_index is None:
    cur_index = jnp.zeros((rows,), jnp.int32)
    cur_token = jnp.zeros((rows, 1), jnp.int32)
  else:
    cur_index = jnp.asarray(initial_index, jnp.int32)
    cur_token = jnp.take_along_axis(sequences, cur_index[:, None], axis=1)
  # A row ends at an EOS beyond those already in its prompt (prompts may hold EOS).
  initial_eos_count = jnp.sum(sequences == eos_id, axis=1, keepdims=True)  # [r, 1]
  row_ids = jnp.arange(rows)

  def body(state: SamplingLoopState) -> SamplingLoopState:
    if state_callback_fn is not None:
      state = state_callback_fn(state)
    if per_row_keys:
      key = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.rng, state.step)
      next_rng = state.rng
    else:
      key, next_rng = jax.random.split(state.rng)
    frozen = isinstance(state.cache, flax.core.FrozenDict)
    logits, new_cache = tokens_to_logits(DecodingState(
        cur_index=state.cur_index, sequences=state.sequences[:, :-2],
        cur_token=state.cur_token, cache=state.cache))  # [r, v]
    if frozen:
      new_cache = flax.core.freeze(new_cache)
    if logit_callback_fn is not None:
      logits = logit_callback_fn(logits, state)
    sampled, sampled_log_prob = draw(logits, key)
    # Rows that started later (initial_index) reach their end first; clamped here, they
    # keep overwriting the garbage slot L + 1 until every row has ended.
    index = jnp.minimum(state.cur_index, max_decode_len)  # [r]
    next_input = state.sequences[row_ids, index + 1]  # [r]; read now: callbacks may edit
    out_of_prompt = next_input == 0
    next_token = jnp.where(out_of_prompt, sampled, next_input)
    log_prob = state.log_prob + (sampled_log_prob * out_of_prompt) * (
        ~state.ended[:, 0]).astype(jnp.int32)
    emitted = (next_token[:, None] * ~state.ended).astype(state.sequences.dtype)  # [r, 1]
    sequences = state.sequences.at[row_ids, index + 1].set(emitted[:, 0])
    eos_added = jnp.sum(sequences == eos_id, axis=1, keepdims=True) > initial_eos_count
    ended = state.ended | eos_added | (index >= max_decode_len - 1)[:, None]
    return SamplingLoopState(step=state.step + 1, cur_index=index + 1, sequences=sequences,
                             cache=new_cache, cur_token=emitted, ended=ended, rng=next_rng,
                             log_prob=log_prob)

  initial = SamplingLoopState(
      step=jnp.zeros((), jnp.int32), cur_index=cur_index, sequences=sequences, cache=cache,
      cur_token=cur_token, ended=jnp.zeros((rows, 1), bool), rng=rng,
      log_prob=jnp.zeros((rows,), jnp.float32))
  final = jax.lax.while_loop(lambda state: ~jnp.all(state.ended), body, initial)
  if state_callback_fn is not None:
    final = state_callback_fn(final)
  return final.sequences[:, 1:-1], final.log_prob


def temperature_sample(inputs, cache, tokens_to_logits: Callable, eos_id: int,
                       decode_rng=None, num_decodes: int = 1, temperature=1.0,
                       topk=1, topp=0.0, cache_offset: int = 0, initial_index=None,
                       max_decode_steps=None, max_decode_steps_hard_limit: int | None = None,
                       rescale_log_probs: bool = True,
                       state_callback_fn: Callable | None = None,
                       logit_callback_fn: Callable | None = None):
  """T5X's `decoding.temperature_sample`: (decodes [B, n, L], log_probs [B, n]).

  inputs [B, L] int32, shifted right: position 0 holds the start token and non-zero
  entries are forced prompt tokens. cache: the decoder cache for batch B, repeated in
  place for the n = num_decodes samples (`cache_map`; batch axis `cache_offset`).
  tokens_to_logits(DecodingState) -> (logits [B*n, V], new cache). decode_rng: one key
  (T5X's stream), or [B*n] per-row keys (jaxspec). temperature: a number or [B]
  (per input row), maybe traced; <= 1e-4 is argmax. topk: 0 disables; topp: 0 disables;
  both non-zero is a ValueError (unless traced). initial_index [B]: each row's position
  of its next input token after a prefilled cache. max_decode_steps: generated tokens
  counted after the prompt (clipped by max_decode_steps_hard_limit when that is > 0).
  rescale_log_probs: scores under the adjusted (temperature/top-k/top-p) distribution,
  or the raw softmax. state_callback_fn(SamplingLoopState) -> SamplingLoopState runs
  before every step and on the final state; logit_callback_fn(logits, state) -> logits.
  Each input's decodes are sorted by log-prob, best last.

  As in T5X, the rows are expanded here and decoded by `_temperature_sample_single_trial`,
  both looked up in this module when called (as T5X's tests mock them).
  """
  inputs = jnp.asarray(inputs).astype(jnp.int32)
  if inputs.ndim != 2:
    raise ValueError(f'inputs must be [batch, length], got shape {inputs.shape}')
  batch = inputs.shape[0]
  if initial_index is not None:
    initial_index = jnp.asarray(initial_index)
    if initial_index.shape != (batch,):
      raise ValueError(f'initial_index must be [batch] = ({batch},), got shape '
                       f'{initial_index.shape}')
  if decode_rng is None:
    decode_rng = jax.random.PRNGKey(0)
  if not _is_single_key(decode_rng) and jnp.shape(decode_rng)[0] != batch * num_decodes:
    raise ValueError(f'decode_rng must be one PRNG key or one per decoded row '
                     f'(batch * num_decodes = {batch * num_decodes}); got shape '
                     f'{jnp.shape(decode_rng)}')
  if (max_decode_steps is not None and max_decode_steps_hard_limit is not None
      and max_decode_steps_hard_limit > 0):
    max_decode_steps = jnp.minimum(max_decode_steps, max_decode_steps_hard_limit)
  if num_decodes > 1:
    expanded_inputs = jnp.repeat(inputs, num_decodes, axis=0)  # [B*n, L], copies adjacent
    # A prefilled cache (initial_index given) holds a per-row cache_index: repeated too.
    expanded_cache = cache_map(
        functools.partial(_repeat_rows, num_decodes=num_decodes, offset=cache_offset),
        cache, apply_to_index=initial_index is not None)
    if initial_index is not None:
      initial_index = jnp.repeat(initial_index, num_decodes)
  else:
    expanded_inputs, expanded_cache = inputs, cache
  expanded_decodes, expanded_log_prob = _temperature_sample_single_trial(
      expanded_inputs, expanded_cache, tokens_to_logits, eos_id, decode_rng, num_decodes,
      temperature, topk, topp, initial_index=initial_index,
      max_decode_steps=max_decode_steps, rescale_log_probs=rescale_log_probs,
      state_callback_fn=state_callback_fn, logit_callback_fn=logit_callback_fn)
  decodes = jnp.reshape(expanded_decodes, (batch, num_decodes, -1))  # [B, n, L]
  scores = jnp.reshape(expanded_log_prob, (batch, num_decodes))  # [B, n]
  order = jnp.argsort(scores, axis=-1)  # ascending: best last
  return (jnp.take_along_axis(decodes, order[:, :, None], axis=1),
          jnp.take_along_axis(scores, order, axis=-1))


def _temperature_sample_single_trial(inputs, cache, tokens_to_logits: Callable, eos_id: int,
                                     prng_key, num_decodes: int = 1, temperature=1.0,
                                     topk=20, topp=0.0, initial_index=None,
                                     max_decode_steps=None, rescale_log_probs: bool = True,
                                     state_callback_fn: Callable | None = None,
                                     logit_callback_fn: Callable | None = None):
  """T5X's `decoding._temperature_sample_single_trial`: the sampling loop over the
  flattened rows r = B * num_decodes, unsorted: (sequences [r, L], log_prob [r]).

  inputs [r, L] and the cache are already repeated (`temperature_sample` does it);
  temperature, topk, topp: a number or one per input row [B] (repeated here for the
  num_decodes copies, as T5X repeats the temperature); initial_index [r]; prng_key: one
  key, or [r] per-row keys. T5X's defaults (topk=20) and its check that topk and topp
  are not both non-zero.
  """
  if not (_is_tracer(topp) or _is_tracer(topk)) and _is_nonzero(topp) and _is_nonzero(topk):
    raise ValueError(f'at most one of topk ({topk}) and topp ({topp}) may be non-zero')
  inputs = jnp.asarray(inputs).astype(jnp.int32)
  rows = inputs.shape[0]
  if rows % num_decodes:
    raise ValueError(f'inputs have {rows} rows, not a multiple of num_decodes '
                     f'({num_decodes})')
  batch = rows // num_decodes
  if not isinstance(temperature, (int, float)):
    temperature = _per_row(temperature, 'temperature', batch, num_decodes)
  if not isinstance(topk, (int, np.integer)):
    topk = _per_row(topk, 'topk', batch, num_decodes)
  if not isinstance(topp, (int, float)):
    topp = _per_row(topp, 'topp', batch, num_decodes)
  per_row_keys = not _is_single_key(prng_key)
  if per_row_keys and jnp.shape(prng_key)[0] != rows:
    raise ValueError(f'prng_key must be one PRNG key or one per row ({rows}); got shape '
                     f'{jnp.shape(prng_key)}')
  max_decode_len = _max_decode_lengths(inputs, max_decode_steps)
  draw = functools.partial(_draw, temperature=temperature, topk=topk, topp=topp,
                           rescale_log_probs=rescale_log_probs, per_row_keys=per_row_keys)
  return _sampling_loop(inputs, cache, tokens_to_logits, eos_id, prng_key, draw,
                        initial_index, max_decode_len, state_callback_fn, logit_callback_fn)


def prefill_decoder_prompt(params, inputs, cache, *, config: T5Config):
  """Feeds decoder prompts into an empty jaxspec cache in ONE decode step.

  inputs [b, L] shifted right (start token 0, then each row's prompt, then 0 padding);
  cache: `T5.init_cache` of at least L positions. Returns (cache holding row b's
  start token and its first n_b - 1 prompt tokens, initial_index [b] = n_b), n_b the
  row's prompt length, for `temperature_sample(inputs, cache, ..., initial_index=...)`,
  which feeds inputs[b, n_b] first (T5X's prefill convention).
  """
  lengths = jnp.sum(inputs != 0, axis=1).astype(jnp.int32)  # [b]
  _, cache = T5(config).apply(params, inputs, cache, method=T5.decode)
  # Positions past n_b hold padding; the loop overwrites them before any query sees them.
  return rollback(cache, lengths), lengths


# jaxspec's own loop (`generate`): per-row keys, non-finite logits flagged per row.


@flax.struct.dataclass
class _LoopState:
  step: jax.Array  # [] int32; every row's current token sits at sequences[:, step]
  sequences: jax.Array  # [b, length + 1]
  token_log_probs: jax.Array  # [b, length] float32, 0 for forced and padding tokens
  ended: jax.Array  # [b] bool
  cache: Any
  row_keys: jax.Array  # [b] per-row PRNG keys
  nonfinite: jax.Array  # [b] bool, the row met non-finite logits and was stopped


def _sample_loop(prompt, cache, tokens_to_logits, row_keys, row_limits,
                 sampling: SamplingConfig, eos_id: int, rescale_log_probs: bool,
                 state_callback_fn=None, logit_callback_fn=None):
  """The decode loop. prompt [b, L] shifted right (0 = free position, start at 0).

  row_limits [b]: row b generates positions 1..row_limits[b] of the sequence.
  Returns sequences [b, L] (without the start token), token log-probs [b, L] and
  nonfinite [b]: rows whose logits held NaN or +inf; such a row ends at that step
  and emits 0 instead of a sample (checked on device, no host round-trip).
  """
  batch, length = prompt.shape
  forced = jnp.pad(prompt, ((0, 0), (0, 1)))  # [b, L+1]; forced[:, i] != 0 is a prompt token

  def cond(state: _LoopState):
    return (state.step < length) & ~jnp.all(state.ended)

  def body(state: _LoopState):
    step = state.step
    cur_token = jax.lax.dynamic_slice_in_dim(state.sequences, step, 1, axis=1)  # [b, 1]
    decoding_state = DecodingState(cur_index=jnp.full((batch,), step, jnp.int32),
                                   sequences=state.sequences[:, :-1], cur_token=cur_token,
                                   cache=state.cache)
    with cpu_matmul.active_rows(~state.ended):  # ended rows cost no kernel products
      logits, cache = tokens_to_logits(decoding_state)  # [b, v]
    if logit_callback_fn is not None:
      logits = logit_callback_fn(logits, decoding_state)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.row_keys, step)
    sampled = jax.vmap(lambda k, l: sample_logits(k, l, sampling))(step_keys, logits)
    log_prob = token_log_probs(logits, sampled, sampling, rescale_log_probs)  # [b]
    broken = ~state.ended & nonfinite_logits(logits)  # [b]
    prompt_token = forced[:, step + 1]
    is_forced = prompt_token != 0
    free = ~state.ended & ~is_forced & ~broken
    next_token = jnp.where(is_forced, prompt_token,
                           jnp.where(state.ended | broken, 0, sampled))
    log_prob = jnp.where(free, log_prob, 0.0)
    ended = (state.ended | broken | (free & (next_token == eos_id))
             | (step + 1 >= row_limits))
    new_state = _LoopState(
        step=step + 1,
        sequences=state.sequences.at[:, step + 1].set(next_token),
        token_log_probs=state.token_log_probs.at[:, step].set(log_prob),
        ended=ended, cache=cache, row_keys=state.row_keys,
        nonfinite=state.nonfinite | broken)
    if state_callback_fn is not None:
      new_state = state_callback_fn(new_state)
    return new_state

  initial = _LoopState(
      step=jnp.zeros((), jnp.int32),
      sequences=jnp.pad(prompt[:, :1], ((0, 0), (0, length))),
      token_log_probs=jnp.zeros((batch, length), jnp.float32),
      ended=row_limits < 1, cache=cache, row_keys=row_keys,
      nonfinite=jnp.zeros((batch,), bool))
  final = jax.lax.while_loop(cond, body, initial)
  return final.sequences[:, 1:], final.token_log_probs, final.nonfinite


def generate(params, encoder_tokens, rng=None, *, config: T5Config, max_decode_length: int,
             sampling: SamplingConfig = SamplingConfig(), eos_id: int = EOS_ID,
             rescale_log_probs: bool = True,
             on_nonfinite: str = 'raise') -> common.DecodeOutput:
  """Decodes encoder_tokens [b, s] with the T5 `params`, one token per step.

  rng: one PRNG key (row b uses fold_in(rng, b)) or per-row keys [b]. Returns a
  DecodeOutput with tokens [b, max_decode_length] (0 after EOS). Runs as one jit.
  on_nonfinite: 'raise' (FloatingPointError naming the rows), 'warn' or 'ignore' when
  a row met NaN/+inf logits (output.nonfinite_logits; the row stopped there).
  """
  params, encoder_tokens, rng = validation.decoder_call(params, encoder_tokens, rng, sampling)
  validation.check_encoder_tokens(encoder_tokens, config.vocab_size)
  validation.check_max_decode_length(max_decode_length)
  validation.check_nonfinite_action(on_nonfinite)
  validation.check_decoder_memory(encoder_tokens, config=config,
                                  max_decode_length=max_decode_length)
  output = _generate(params, encoder_tokens, rng, config=config,
                     max_decode_length=max_decode_length, sampling=sampling, eos_id=eos_id,
                     rescale_log_probs=rescale_log_probs)
  validation.report_nonfinite_rows(output.nonfinite_logits, on_nonfinite)
  return output


@functools.partial(jax.jit, static_argnames=('config', 'max_decode_length', 'sampling',
                                             'eos_id', 'rescale_log_probs'))
def _generate(params, encoder_tokens, rng, *, config: T5Config, max_decode_length: int,
              sampling: SamplingConfig, eos_id: int, rescale_log_probs: bool):
  model = T5(config)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, max_decode_length,
                      method=T5.init_cache)

  def tokens_to_logits(state: DecodingState):
    logits, new_cache = model.apply(params, state.cur_token, state.cache, method=T5.decode)
    return logits[:, 0], new_cache

  batch = encoder_tokens.shape[0]
  prompt = jnp.zeros((batch, max_decode_length), jnp.int32)
  row_limits = jnp.full((batch,), max_decode_length, jnp.int32)
  tokens, log_probs, nonfinite = _sample_loop(
      prompt, cache, tokens_to_logits, common.row_keys(rng, batch), row_limits, sampling,
      eos_id, rescale_log_probs)
  return common.DecodeOutput.from_tokens(tokens, log_probs, eos_id, nonfinite)

"""The baseline decoder: T5X-compatible temperature sampling, one token per step.

`temperature_sample` has T5X's signature and semantics (argmax at temperature <=
1e-4, top-k, top-p, forced prompt tokens, a row ends at its first EOS and emits 0
after it, results sorted by log-prob, best last) and runs as one `lax.while_loop`.
`generate` runs it on a jaxspec T5: encode once, cross-attention keys/values cached
once, one cached decode step per token, all inside one `jax.jit`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec import validation
from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding import common
from jaxspec.model import T5
from jaxspec.sampling import SamplingConfig, nonfinite_logits, sample_logits, token_log_probs


@flax.struct.dataclass
class DecodingState:
  """What `tokens_to_logits` sees each step (T5X's field names)."""
  cur_index: jax.Array  # [b] int32, position of cur_token in `sequences`
  sequences: jax.Array  # [b, length + 1] int32, start token at position 0
  cur_token: jax.Array  # [b, 1] int32
  cache: Any


@flax.struct.dataclass
class _LoopState:
  step: jax.Array  # [] int32; every row's current token sits at sequences[:, step]
  sequences: jax.Array  # [b, length + 1]
  token_log_probs: jax.Array  # [b, length] float32, 0 for forced and padding tokens
  ended: jax.Array  # [b] bool
  cache: Any
  row_keys: jax.Array  # [b] per-row PRNG keys
  nonfinite: jax.Array  # [b] bool, the row met non-finite logits and was stopped


def _sampling_config(temperature, topk, topp) -> SamplingConfig:
  return SamplingConfig(temperature=float(temperature), top_k=int(topk),
                        top_p=float(topp) if topp and topp > 0 else 1.0)


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
                                   sequences=state.sequences, cur_token=cur_token,
                                   cache=state.cache)
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


def temperature_sample(inputs, cache, tokens_to_logits: Callable, eos_id: int,
                       decode_rng=None, num_decodes: int = 1, temperature: float = 1.0,
                       topk: int = 1, topp: float = 0.0, cache_offset: int = 0,
                       initial_index=None, max_decode_steps: int | None = None,
                       max_decode_steps_hard_limit: int | None = None,
                       rescale_log_probs: bool = True, state_callback_fn=None,
                       logit_callback_fn=None):
  """T5X's `decoding.temperature_sample`: (decodes [B, n, L], log_probs [B, n]).

  inputs [B, L] int32 are shifted right: position 0 holds the start token and other
  non-zero entries are forced prompt tokens. `cache` holds batch B and is repeated
  for the n = num_decodes samples. tokens_to_logits(DecodingState) -> (logits [B*n, V],
  new_cache). Each input's decodes are sorted by log-prob, best last.
  """
  if cache_offset:
    raise ValueError('cache_offset is not supported: jaxspec caches are per row, '
                     'pass a cache whose rows already hold any shared prefix')
  if initial_index is not None:
    raise ValueError('initial_index is not supported: pass prompts as non-zero inputs')
  batch, length = inputs.shape
  sampling = _sampling_config(temperature, topk, topp)
  prompt = jnp.repeat(inputs.astype(jnp.int32), num_decodes, axis=0)
  # Every leaf with a batch axis is repeated; scalars (e.g. T5X's cache_index) are shared.
  cache = jax.tree_util.tree_map(
      lambda x: jnp.repeat(x, num_decodes, axis=0) if jnp.ndim(x) else x, cache)
  prompt_length = jnp.sum(prompt[:, 1:] != 0, axis=1)
  steps = length
  if max_decode_steps is not None:
    if max_decode_steps_hard_limit is not None:  # As T5X: it only clips max_decode_steps.
      max_decode_steps = jnp.minimum(max_decode_steps, max_decode_steps_hard_limit)
    steps = jnp.minimum(steps, prompt_length + max_decode_steps)
  row_limits = jnp.broadcast_to(steps, (batch * num_decodes,)).astype(jnp.int32)
  rng = decode_rng if decode_rng is not None else jax.random.PRNGKey(0)
  row_keys = common.row_keys(rng, batch * num_decodes)
  # T5X's return values have no room for the non-finite flag; such rows still end.
  sequences, log_probs, _ = _sample_loop(
      prompt, cache, tokens_to_logits, row_keys, row_limits, sampling, eos_id,
      rescale_log_probs, state_callback_fn, logit_callback_fn)
  sequences = sequences.reshape(batch, num_decodes, length)
  scores = jnp.sum(log_probs, axis=1).reshape(batch, num_decodes)
  order = jnp.argsort(scores, axis=1)  # ascending: best last
  return (jnp.take_along_axis(sequences, order[:, :, None], axis=1),
          jnp.take_along_axis(scores, order, axis=1))


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
  validation.check_encoder_tokens(encoder_tokens, config.vocab_size)
  validation.check_max_decode_length(max_decode_length)
  validation.check_nonfinite_action(on_nonfinite)
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

"""Draft training for agreement with the target (paper 3.6; DistillSpec, Zhou et al. 2024).

alpha, the rate speculative decoding accepts drafts at, is E[sum_x min(p, q)] =
1 - E[TV(p, q)] over the prefixes the TARGET produces. Token-level distillation on
references (`jaxspec.training.core`) matches p only where the references go; here the
draft is trained on the teacher's full distribution p at every position of
sequences it will actually meet:

- `position_divergence`: forward KL, reverse KL, generalized JSD(beta) or total
  variation between p and the draft's q at every position (a `DivergenceConfig`).
- `DataMixConfig`, `batch_source`, `on_policy_batch`: each step's target sequences are
  the references, or decoded on the fly from the step's training inputs by the draft
  (its own samples: on-policy), by the teacher (samples or greedy), in a set mix, with
  `jaxspec.decoding.baseline.generate` (one jit, fixed shapes, per-row keys).
- `noised_inputs`: training inputs with random pieces swapped in, so that a teacher
  that memorized its training split decodes them as it decodes unseen inputs.
- `greedy_targets`, `teacher_fingerprint`: sequence-level distillation, the teacher's
  greedy outputs for the training inputs computed once (the caller caches them on disk
  under the teacher's fingerprint) and used as references.
- `distill_step`: one jitted optimizer step on the divergence over a batch's positions.

Shape letters: b batch, s input length, t target length, v vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec import paths
from jaxspec.config import T5Config
from jaxspec.decoding import baseline
from jaxspec.model import T5
from jaxspec.sampling import MIN_TEMPERATURE, SamplingConfig
from jaxspec.training.core import LENGTH_QUANTUM, length_bucket

DIVERGENCES = ('forward_kl', 'reverse_kl', 'jsd', 'tvd')
SOURCES = ('draft_samples', 'target_samples', 'target_greedy', 'references')


# ---------------------------------------------------------------------------
# Divergences between the teacher's p and the draft's q.


@dataclasses.dataclass(frozen=True)
class DivergenceConfig:
  """Which divergence the draft minimizes at every position. Hashable (static under jit).

  temperature: p and q are compared as softmax(logits / temperature). At 0 (argmax
  decoding) p is the teacher's argmax one-hot and q stays the draft's softmax at
  temperature 1 (an argmax has no gradient): TVD is then 1 - q(argmax p), which
  falls as the draft's argmax agreement rises, and forward KL is the cross-entropy
  on the teacher's argmax.
  """

  name: str = 'tvd'  # One of DIVERGENCES.
  # jsd only: JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q.
  beta: float = 0.5
  temperature: float = 1.0
  z_loss: float = 1e-4  # T5X's penalty on the draft's log Z, keeps logits from drifting.

  def __post_init__(self):
    if self.name not in DIVERGENCES:
      raise ValueError(f'divergence must be one of {DIVERGENCES}, got {self.name!r}')
    if not 0.0 < self.beta < 1.0:
      raise ValueError(f'jsd beta must be in (0, 1), got {self.beta}')
    if not self.temperature >= 0.0:
      raise ValueError(f'divergence temperature must be >= 0, got {self.temperature}')
    if self.name == 'reverse_kl' and self.is_greedy:
      raise ValueError("reverse_kl is infinite against the teacher's argmax one-hot "
                       '(temperature 0): use tvd, forward_kl or jsd there')

  @property
  def is_greedy(self) -> bool:
    return self.temperature <= MIN_TEMPERATURE


def compared_log_probs(teacher_logits, draft_logits, config: DivergenceConfig):
  """(p, log p, q, log q) [..., v] float32 as `config` compares them.

  log p is 0 (not -inf) where p is 0, so no term below ever multiplies 0 by -inf.
  """
  teacher_logits = teacher_logits.astype(jnp.float32)
  draft_logits = draft_logits.astype(jnp.float32)
  if config.is_greedy:
    p = jax.nn.one_hot(jnp.argmax(teacher_logits, axis=-1), teacher_logits.shape[-1],
                       dtype=jnp.float32)  # [..., v]
    log_p = jnp.zeros_like(p)
    log_q = jax.nn.log_softmax(draft_logits, axis=-1)
  else:
    log_p = jax.nn.log_softmax(teacher_logits / config.temperature, axis=-1)  # [..., v]
    p = jnp.exp(log_p)
    log_q = jax.nn.log_softmax(draft_logits / config.temperature, axis=-1)
  return p, log_p, jnp.exp(log_q), log_q


def _kl_terms(a, log_a, log_b):
  """sum_x a (log a - log b) [...], with 0 log 0 = 0."""
  return jnp.sum(jnp.where(a > 0, a * (log_a - log_b), 0.0), axis=-1)


def position_divergence(teacher_logits, draft_logits, config: DivergenceConfig):
  """D(p, q) [...] at every position; logits [..., v]. Gradients flow into the draft only."""
  p, log_p, q, log_q = compared_log_probs(jax.lax.stop_gradient(teacher_logits),
                                          draft_logits, config)
  if config.name == 'forward_kl':
    return _kl_terms(p, log_p, log_q)
  if config.name == 'reverse_kl':
    return jnp.sum(q * (log_q - log_p), axis=-1)
  if config.name == 'jsd':
    mixture = config.beta * p + (1.0 - config.beta) * q  # [..., v]
    log_mixture = jnp.log(jnp.maximum(mixture, 1e-30))
    return (config.beta * _kl_terms(p, log_p, log_mixture)
            + (1.0 - config.beta) * _kl_terms(q, log_q, log_mixture))
  # TV's subgradient at p == q is 0 (jnp.abs'), finite everywhere.
  return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)


# ---------------------------------------------------------------------------
# Where each step's target sequences come from.


@dataclasses.dataclass(frozen=True)
class DataMixConfig:
  """The share of training batches whose targets come from each source (normalized).

  draft_samples: the draft's own samples (on-policy); target_samples: the teacher's
  samples; target_greedy: the teacher's greedy outputs; references: the corpus.
  Samples are drawn at `temperature`.
  """

  draft_samples: float = 0.0
  target_samples: float = 0.0
  target_greedy: float = 0.0
  references: float = 1.0
  temperature: float = 1.0

  def __post_init__(self):
    shares = self.shares
    if any(not share >= 0.0 for share in shares) or sum(shares) <= 0.0:
      raise ValueError(f'data mix shares must be >= 0 with a positive sum, got '
                       f'{dict(zip(SOURCES, shares))}')
    if not self.temperature >= 0.0:
      raise ValueError(f'data mix temperature must be >= 0, got {self.temperature}')

  @property
  def shares(self) -> tuple[float, ...]:
    return tuple(float(getattr(self, source)) for source in SOURCES)

  @property
  def references_only(self) -> bool:
    return self.draft_samples == self.target_samples == self.target_greedy == 0.0


def batch_source(mix: DataMixConfig, seed: int, step: int) -> str:
  """The source of step `step`'s targets: a draw fixed by (seed, step) alone, so a
  resumed run sees the sources an unbroken one does."""
  shares = np.asarray(mix.shares)
  return SOURCES[np.random.RandomState([seed, step, 14]).choice(len(SOURCES),
                                                               p=shares / shares.sum())]


def step_key(seed: int, step: int):
  """The PRNG key of step `step`'s sampled targets (a function of seed and step)."""
  return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def sequences_batch(inputs, tokens, lengths,
                    quantum: int = LENGTH_QUANTUM) -> dict[str, np.ndarray]:
  """Decoded tokens [b, L] (0 after EOS), lengths [b] -> a training batch.

  Targets are cut to the length bucket of the longest row (`training.length_bucket`, so
  few shapes compile); 'mask' [b, t] marks every decoded position through EOS, even a
  sampled token 0, which a `targets > 0` mask would drop.
  """
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  length = min(length_bucket(int(lengths.max()), quantum), tokens.shape[1])
  targets = tokens[:, :length]  # [b, t]
  mask = np.arange(length)[None, :] < lengths[:, None]  # [b, t]
  decoder_inputs = np.pad(targets[:, :-1], ((0, 0), (1, 0)))  # start token 0
  return {'inputs': np.asarray(inputs), 'targets': targets,
          'decoder_inputs': decoder_inputs, 'mask': mask}


def with_mask(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A reference batch with its 'mask' [b, t]: the non-padding targets."""
  return dict(batch, mask=np.asarray(batch['targets']) > 0)


def on_policy_batch(batch: dict[str, np.ndarray], source: str, rng, *, mix: DataMixConfig,
                    max_decode_length: int, draft_params, draft_config: T5Config, teacher_params,
                    teacher_config: T5Config,
                    quantum: int = LENGTH_QUANTUM) -> dict[str, np.ndarray]:
  """The training batch of one step: batch's inputs, targets from `source`.

  batch: a reference batch ('inputs' [b, s], 'targets' [b, t]); params are
  {'params': tree}. Decoded sources replace the targets by generate's output from
  the inputs, up to max_decode_length tokens (row r keyed by fold_in(rng, r)).
  """
  if source == 'references':
    return with_mask(batch)
  if source not in SOURCES:
    raise ValueError(f'batch source must be one of {SOURCES}, got {source!r}')
  params, config = ((draft_params, draft_config) if source == 'draft_samples'
                    else (teacher_params, teacher_config))
  temperature = 0.0 if source == 'target_greedy' else mix.temperature
  output = baseline.generate(params, batch['inputs'], rng, config=config,
                             max_decode_length=max_decode_length,
                             sampling=SamplingConfig(temperature=temperature))
  return sequences_batch(batch['inputs'], output.tokens, output.lengths, quantum)


FIRST_PIECE = 3  # Vocabulary ids below it are padding, EOS and unknown.


def noised_inputs(inputs, rate: float, vocab_size: int, seed: int, step: int) -> np.ndarray:
  """inputs [b, s] with each token (not padding, not EOS) replaced, with probability
  `rate`, by a piece drawn uniformly from the vocabulary; fixed by (seed, step).

  A teacher that has nearly memorized its training split answers a training input with
  its reference; on a noised input it shows its own behaviour, as on held-out inputs,
  which is what a draft must learn to agree with.
  """
  inputs = np.array(inputs, np.int32)
  if rate <= 0.0:
    return inputs
  rng = np.random.RandomState([seed, step, 15])
  replace = (rng.random_sample(inputs.shape) < rate) & (inputs >= FIRST_PIECE)
  pieces = rng.randint(FIRST_PIECE, vocab_size, inputs.shape).astype(np.int32)
  return np.where(replace, pieces, inputs)


# ---------------------------------------------------------------------------
# Sequence-level distillation: the teacher's greedy outputs as references.


def teacher_fingerprint(params, config: T5Config, *details: Any) -> str:
  """A hex digest of the teacher's weights, its config and `details` (a cache key)."""
  digest = hashlib.sha256(repr((config, details)).encode())
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, leaf in flat:
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return digest.hexdigest()


def greedy_targets(params, config: T5Config, input_ids: Sequence[Sequence[int]],
                   max_decode_length: int, batch_size: int = 64,
                   quantum: int = LENGTH_QUANTUM) -> list[list[int]]:
  """The teacher's greedy output for each input, through its EOS (or max_decode_length
  tokens when it never ends). params: {'params': tree}.

  Inputs are decoded in length order, padded to their length bucket and to
  batch_size rows, so only a few shapes compile.
  """
  order = sorted(range(len(input_ids)), key=lambda i: len(input_ids[i]))
  outputs: list[list[int]] = [[] for _ in input_ids]
  for start in range(0, len(order), batch_size):
    rows = order[start:start + batch_size]
    width = length_bucket(max(len(input_ids[i]) for i in rows), quantum)
    inputs = np.zeros((batch_size, width), np.int32)  # [b, s]
    for slot, index in enumerate(rows):
      inputs[slot, :len(input_ids[index])] = input_ids[index]
    inputs[len(rows):] = inputs[len(rows) - 1]  # Padding rows repeat a real one.
    output = baseline.generate(params, inputs, config=config,
                               max_decode_length=max_decode_length,
                               sampling=SamplingConfig(temperature=0.0))
    tokens, lengths = np.asarray(output.tokens), np.asarray(output.lengths)
    for slot, index in enumerate(rows):
      outputs[index] = tokens[slot, :lengths[slot]].tolist()
  return outputs


def sequence_kd_pairs(pairs, teacher_params, teacher_model: T5Config, target_length: int,
                      cache_dir: str | None, batch_size: int = 64,
                      quantum: int = LENGTH_QUANTUM) -> list[tuple[list[int], list[int]]]:
  """pairs (input ids, target ids) with every target replaced by the teacher's greedy
  output (teacher_params: the tree without the 'params' key).

  Decoded once; with a cache_dir, kept there under the fingerprint of the teacher's
  weights, its config, the inputs and the length, and read back by later runs.
  """
  input_ids = [pair[0] for pair in pairs]
  cache_file = None
  if cache_dir:
    key = teacher_fingerprint(teacher_params, teacher_model, target_length,
                              json.dumps(input_ids))
    cache_file = os.path.join(cache_dir, f'greedy_targets_{key[:24]}.npz')
    if os.path.exists(cache_file):
      with np.load(cache_file) as cached:
        targets = np.split(cached['tokens'], cached['ends'][:-1])
      print(f'teacher greedy targets read from {cache_file}', flush=True)
      return [(inputs, row.tolist()) for inputs, row in zip(input_ids, targets)]
  started = time.time()
  targets = greedy_targets({'params': teacher_params}, teacher_model, input_ids,
                           target_length, batch_size, quantum)
  print(f'teacher greedy targets for {len(targets)} inputs in {time.time() - started:.0f} s',
        flush=True)
  if cache_file:
    os.makedirs(cache_dir, exist_ok=True)
    contents = io.BytesIO()
    np.savez(contents, tokens=np.concatenate([np.asarray(t, np.int32) for t in targets]),
             ends=np.cumsum([len(t) for t in targets]))
    paths.atomic_write(cache_file, contents.getvalue())
  return [(inputs, row) for inputs, row in zip(input_ids, targets)]


# ---------------------------------------------------------------------------
# The jitted step.


def distillation_loss(draft_logits, teacher_logits, mask, config: DivergenceConfig):
  """(summed loss, summed divergence, token count) over mask [b, t]; logits [b, t, v]."""
  mask = mask.astype(jnp.float32)
  divergence = position_divergence(teacher_logits, draft_logits, config)  # [b, t]
  log_z = jax.nn.logsumexp(draft_logits.astype(jnp.float32), axis=-1)  # [b, t]
  loss = divergence + config.z_loss * jnp.square(log_z)
  return jnp.sum(loss * mask), jnp.sum(divergence * mask), jnp.sum(mask)


def agreement(teacher_logits, draft_logits, mask):
  """On-batch beta at temperatures 1 and 0 (sum_x min(p, q); argmax equality), summed
  over mask [b, t]: a cheap progress signal, not the validation alpha."""
  p = jax.nn.softmax(teacher_logits.astype(jnp.float32), axis=-1)  # [b, t, v]
  q = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
  beta_sampled = jnp.sum(jnp.minimum(p, q), axis=-1)  # [b, t]
  beta_greedy = jnp.argmax(teacher_logits, axis=-1) == jnp.argmax(draft_logits, axis=-1)
  mask = mask.astype(jnp.float32)
  return jnp.sum(beta_sampled * mask), jnp.sum(beta_greedy * mask)


@functools.partial(jax.jit, static_argnames=('config', 'teacher_config', 'optimizer',
                                             'divergence'), donate_argnums=(0, 1))
def distill_step(params, opt_state, batch, teacher_params, *, config: T5Config,
                 teacher_config: T5Config, optimizer: optax.GradientTransformation,
                 divergence: DivergenceConfig):
  """One optimizer step of the draft `params` on the divergence from the teacher.

  batch: 'inputs' [b, s], 'decoder_inputs' [b, t], 'mask' [b, t]; params and
  teacher_params are bare trees. Returns (params, opt_state, metrics).
  """
  teacher_logits = jax.lax.stop_gradient(T5(teacher_config).apply(
      {'params': teacher_params}, batch['inputs'], batch['decoder_inputs']))  # [b, t, v]

  def loss_fn(p):
    logits = T5(config).apply({'params': p}, batch['inputs'], batch['decoder_inputs'])
    total, divergence_sum, count = distillation_loss(logits, teacher_logits, batch['mask'],
                                                     divergence)
    return total / jnp.maximum(count, 1.0), (logits, divergence_sum, count)

  (loss, (logits, divergence_sum, count)), grads = jax.value_and_grad(
      loss_fn, has_aux=True)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  beta_sampled, beta_greedy = agreement(teacher_logits, logits, batch['mask'])
  tokens = jnp.maximum(count, 1.0)
  metrics = {'loss': loss, 'divergence': divergence_sum / tokens, 'tokens': count,
             'batch_beta_t1': beta_sampled / tokens, 'batch_beta_t0': beta_greedy / tokens,
             'grad_norm': optax.tree.norm(grads)}
  return params, opt_state, metrics

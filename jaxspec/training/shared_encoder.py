"""Training an encoder-sharing draft decoder against a frozen target.

Every step encodes the batch with the TARGET's encoder (no gradient: the target is
frozen and the draft has no encoder of its own), runs the draft decoder teacher forced
over that encoding, and takes T5X's loss (jaxspec.training.core.token_losses): cross-entropy
on the references, mixed with the cross-entropy against the target's own next-token
distribution at every position when LossConfig.distill_weight > 0 (the target's
logits come from the same encoding). Only the draft's parameters are updated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxspec.config import T5Config
from jaxspec.model import T5
from jaxspec.model.shared_encoder_draft import SharedEncoderDraft
from jaxspec.training.core import LossConfig, descend


def target_encoding(target_params, batch, *, target_config: T5Config, with_logits: bool):
  """The frozen target on a batch: (encoded [b, s, e], teacher logits [b, t, v] or None).

  Both are under stop_gradient; the logits are the target's teacher-forced logits over
  batch['decoder_inputs'], from the same encoding.
  """
  model = T5(target_config)
  encoded = model.apply(target_params, batch['inputs'], method=T5.encode)
  logits = None
  if with_logits:
    cache = model.apply(target_params, encoded, batch['inputs'],
                        batch['decoder_inputs'].shape[1], method=T5.init_cache)
    logits, _ = model.apply(target_params, batch['decoder_inputs'], cache, method=T5.decode)
    logits = jax.lax.stop_gradient(logits)
  return jax.lax.stop_gradient(encoded), logits


@functools.partial(jax.jit, static_argnames=('config', 'encoder_dim', 'optimizer',
                                             'loss_config', 'target_config'),
                   donate_argnums=(0, 1))
def train_step(params, opt_state, batch, target_params, *, config: T5Config,
               encoder_dim: int, optimizer: optax.GradientTransformation,
               loss_config: LossConfig, target_config: T5Config):
  """One optimizer step of the draft decoder `params` ({'params'} tree, without the
  collection key); returns (params, opt_state, metrics) as jaxspec.training.core.train_step."""
  encoded, teacher_logits = target_encoding(
      target_params, batch, target_config=target_config,
      with_logits=loss_config.distill_weight > 0)
  model = SharedEncoderDraft(config, encoder_dim)

  def logits_fn(p):
    return model.apply({'params': p}, encoded, batch['inputs'], batch['decoder_inputs'])

  return descend(params, opt_state, optimizer, logits_fn, batch['targets'], loss_config,
                 teacher_logits)


@functools.partial(jax.jit, static_argnames=('config', 'encoder_dim', 'target_config'))
def eval_step(params, batch, target_params, *, config: T5Config, encoder_dim: int,
              target_config: T5Config):
  """Summed reference cross-entropy, argmax tokens equal to the reference, argmax tokens
  equal to the target's argmax (teacher forced, T=0 agreement), and the token count."""
  encoded, target_logits = target_encoding(target_params, batch, target_config=target_config,
                                           with_logits=True)
  logits = SharedEncoderDraft(config, encoder_dim).apply(
      {'params': params}, encoded, batch['inputs'], batch['decoder_inputs'])
  mask = batch['targets'] > 0
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, batch['targets'][..., None], axis=-1)[..., 0]
  draft_argmax = jnp.argmax(logits, axis=-1)
  correct = (draft_argmax == batch['targets']) & mask
  agree = (draft_argmax == jnp.argmax(target_logits, axis=-1)) & mask
  return jnp.sum(nll * mask), jnp.sum(correct), jnp.sum(agree), jnp.sum(mask)

"""Training a feature-level draft head (jaxspec.model.feature_draft) against a frozen target.

Each step runs the frozen target teacher forced over the batch (encoder, then every decoder
position in one step), which gives at every slot j its final hidden state h_j and its
logits, the distribution of x_{j+1}. The head reads [h_{j-1}, embed(x_j)] at slot j and
predicts h_j; the loss, as EAGLE's, is

    feature_weight * smooth-L1(predicted h_j, h_j), averaged over the features
      + cross-entropy of the target's distribution under the head's (the head's predicted
        h_j through the target's LM head; KL up to the target's entropy)

averaged over non-padding positions. The target's products come from the target run in
the step, or from a batch that carries them (jaxspec.training.target_features). With
`unroll` > 1 the head also runs again on its own predictions (slot j then reads its
predicted h_{j-1} instead of the target's), as later draft steps of a proposal do, and
every pass's loss counts; `feature_noise` adds uniform noise of that half-width to the
target features the first pass reads. Only the head's parameters are updated; the
target's embedding and LM head are frozen.

With `feature_layers` (EAGLE-3's fused features) the target also gives those decoder
layers' outputs (jaxspec.model.t5.layer_feature) after h; the head's first pass reads
them, its later passes read zeros there (as draft steps reading a prediction do), and the
regression is of h alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from jaxspec.config import T5Config
from jaxspec.errors import InvalidSetting
from jaxspec.model import T5
from jaxspec.model.cache import DecoderCache, LayerCache
from jaxspec.model import feature_draft


@dataclasses.dataclass(frozen=True)
class FeatureLossConfig:
  """The head's loss (module docstring)."""
  feature_weight: float = 1.0  # Weight of the smooth-L1 regression of features.
  distill_weight: float = 0.5  # Weight of the cross-entropy against the target's p.
  unroll: int = 2  # Passes: 1 reads only the target's features; 2+ also its own.
  feature_noise: float = 0.0  # Half-width of uniform noise on the first pass's features.

  def __post_init__(self):
    if self.unroll < 1:
      raise InvalidSetting(f'unroll must be >= 1 (passes of the head), got {self.unroll}')
    if self.feature_noise < 0:
      raise InvalidSetting(f'feature_noise must be >= 0, got {self.feature_noise}')


def target_features(target_params, batch, *, target_config: T5Config,
                    feature_layers: tuple[int, ...] = ()):
  """The frozen target on a batch, teacher forced: (features [b, t, e (1 + n)]: h after its
  final norm, then feature_layers' outputs; logits [b, t, v]; its DecoderCache for the
  head's cross-attention), all under stop_gradient."""
  model = T5(target_config)
  encoded = model.apply(target_params, batch['inputs'], method=T5.encode)
  cache = model.apply(target_params, encoded, batch['inputs'],
                      batch['decoder_inputs'].shape[1], method=T5.init_cache)
  logits, features, cache = model.apply(target_params, batch['decoder_inputs'], cache,
                                        feature_layers=feature_layers,
                                        method=T5.decode_with_features)
  return jax.lax.stop_gradient((features, logits, cache))


def stored_target_features(target_params, batch, *, target_config: T5Config,
                           feature_layers: tuple[int, ...] = ()):
  """As target_features, from what jaxspec.training.target_features stored for the batch
  ('target_features' [b, t, e (1 + n)], stored with these feature_layers; the last
  layer's 'cross_keys'/'cross_values' [b, h, d, s]):
  only the LM head runs (the logits), and the cache holds just that last layer, all the
  head reads of it."""
  features = batch['target_features']
  width = target_config.emb_dim * (1 + len(feature_layers))
  if features.shape[-1] != width:
    raise ValueError(f'stored target features of width {features.shape[-1]}, the head reads '
                     f'{width} (feature_layers {feature_layers})')
  logits = T5(target_config).apply(target_params, features[..., :target_config.emb_dim],
                                   method=T5.logits_from_features)
  keys = batch['cross_keys']
  empty = jnp.zeros(keys.shape[:3] + (0,), keys.dtype)  # [b, h, d, 0]: no decoder slots
  cache = DecoderCache(
      layers=(LayerCache(self_keys=empty, self_values=empty, cross_keys=keys,
                         cross_values=batch['cross_values']),),
      encoder_mask=batch['inputs'] > 0, end_index=jnp.zeros((keys.shape[0],), jnp.int32))
  return jax.lax.stop_gradient((features, logits, cache))


def head_passes(head_params, target_params, features, target_cache, decoder_inputs, *,
                config: T5Config, target_config: T5Config, unroll: int, noise=None,
                num_feature_layers: int = 0):
  """The head teacher forced, `unroll` passes -> predicted features [unroll, b, t, e].

  Pass 0 reads the target's features [b, t, e (1 + n)] shifted by one slot (plus `noise`
  of their shape when given); pass k reads pass k-1's predictions [b, t, e], shifted
  alike (zeros for the n layers' outputs)."""
  embeddings = T5(target_config).apply(target_params, decoder_inputs, method=T5.embed)
  head = feature_draft.FeatureDraft(config, num_feature_layers=num_feature_layers)
  length = decoder_inputs.shape[1]
  read = features if noise is None else features + noise
  passes = []
  for _ in range(unroll):
    cache = feature_draft.init_cache(config, target_cache, length)
    predicted, _ = head.apply({'params': head_params}, feature_draft.shifted_features(read),
                              embeddings,
                              cache)
    passes.append(predicted)
    read = predicted
  return jnp.stack(passes)


def _draft_logits(target_params, predicted, target_config: T5Config):
  """predicted features [n, b, t, e] -> logits [n, b, t, v] through the target's LM head."""
  logits = T5(target_config).apply(target_params, predicted.reshape((-1,) + predicted.shape[2:]),
                                   method=T5.logits_from_features)
  return logits.reshape(predicted.shape[:3] + logits.shape[-1:])


def head_losses(predicted, features, target_logits, draft_logits, mask, loss: FeatureLossConfig):
  """predicted [n, b, t, e], features [b, t, e] (h; wider: the first e), target_logits
  [b, t, v], draft_logits [n, b, t, v], mask [b, t] -> (loss, regression, cross-entropy,
  agreement of argmaxes per pass [n]), each averaged over the mask (summed over the
  passes for the loss)."""
  count = jnp.maximum(jnp.sum(mask), 1.0)
  features = features[..., :predicted.shape[-1]]
  regression = jnp.mean(optax.huber_loss(predicted, features[None]), axis=-1)  # [n, b, t]
  target_probs = jax.nn.softmax(target_logits, axis=-1)  # [b, t, v]
  cross_entropy = -jnp.sum(target_probs[None] * jax.nn.log_softmax(draft_logits, axis=-1),
                           axis=-1)  # [n, b, t]
  agree = jnp.argmax(draft_logits, axis=-1) == jnp.argmax(target_logits, axis=-1)[None]
  mean = lambda x: jnp.sum(x * mask[None], axis=(1, 2)) / count  # noqa: E731  [n]
  total = jnp.sum(loss.feature_weight * mean(regression) + loss.distill_weight * mean(cross_entropy))
  return total, mean(regression), mean(cross_entropy), mean(agree.astype(jnp.float32))


def _forward(head_params, target_params, batch, rng, *, config, target_config, loss,
             feature_layers):
  of_target = stored_target_features if 'target_features' in batch else target_features
  features, target_logits, target_cache = of_target(target_params, batch,
                                                    target_config=target_config,
                                                    feature_layers=feature_layers)
  noise = None
  if loss.feature_noise > 0 and rng is not None:
    noise = jax.random.uniform(rng, features.shape, features.dtype, -loss.feature_noise,
                               loss.feature_noise)
  predicted = head_passes(head_params, target_params, features, target_cache,
                          batch['decoder_inputs'], config=config, target_config=target_config,
                          unroll=loss.unroll, noise=noise,
                          num_feature_layers=len(feature_layers))
  draft_logits = _draft_logits(target_params, predicted, target_config)
  mask = (batch['targets'] > 0).astype(jnp.float32)
  return head_losses(predicted, features, target_logits, draft_logits, mask, loss)


@functools.partial(jax.jit, static_argnames=('config', 'target_config', 'optimizer', 'loss',
                                             'feature_layers'),
                   donate_argnums=(0, 1))
def train_step(head_params, opt_state, batch, target_params, rng, *, config: T5Config,
               target_config: T5Config, optimizer: optax.GradientTransformation,
               loss: FeatureLossConfig, feature_layers: tuple[int, ...] = ()):
  """One optimizer step of the head's params tree (without the collection key); -> (params, opt_state,
  metrics: loss, feature regression, cross-entropy and argmax agreement per pass)."""
  def loss_fn(p):
    total, regression, cross_entropy, agree = _forward(
        p, target_params, batch, rng, config=config, target_config=target_config, loss=loss,
        feature_layers=feature_layers)
    return total, (regression, cross_entropy, agree)

  (total, (regression, cross_entropy, agree)), grads = jax.value_and_grad(
      loss_fn, has_aux=True)(head_params)
  updates, opt_state = optimizer.update(grads, opt_state, head_params)
  head_params = optax.apply_updates(head_params, updates)
  metrics = {'loss': total, 'regression': regression, 'cross_entropy': cross_entropy,
             'agreement': agree, 'grad_norm': optax.tree.norm(grads)}
  return head_params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=('config', 'target_config', 'unroll',
                                             'feature_layers'))
def eval_step(head_params, batch, target_params, *, config: T5Config, target_config: T5Config,
              unroll: int = 2, feature_layers: tuple[int, ...] = ()):
  """Argmax agreement with the target summed per pass [unroll] and the token count: on the
  target's own greedy outputs, pass 0's agreement is alpha at temperature 0 of a first
  draft, pass k's that of a draft k steps into a proposal (reading k predicted features)."""
  features, target_logits, target_cache = target_features(target_params, batch,
                                                          target_config=target_config,
                                                          feature_layers=feature_layers)
  predicted = head_passes(head_params, target_params, features, target_cache,
                          batch['decoder_inputs'], config=config, target_config=target_config,
                          unroll=unroll, num_feature_layers=len(feature_layers))
  draft_logits = _draft_logits(target_params, predicted, target_config)
  mask = batch['targets'] > 0
  agree = (jnp.argmax(draft_logits, axis=-1) == jnp.argmax(target_logits, axis=-1)[None]) & mask
  return jnp.sum(agree, axis=(1, 2)), jnp.sum(mask)

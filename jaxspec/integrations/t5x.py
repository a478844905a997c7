"""Decoding with jaxspec from inside T5X, without t5x as a dependency of jaxspec.

T5X offers two ways to change how a model decodes (t5x docs/usage/decoding.md):

1. A decode function with T5X's `DecodeFnCallable` signature, set as
   `models.EncoderDecoderModel.decode_fn`: `temperature_sample` here (re-exported
   from jaxspec.decoding.baseline) is T5X's temperature sampling, one token per step.
2. A model class overriding `predict_batch_with_aux`: speculative decoding needs it,
   because T5X's `tokens_to_logits` and cache take one token per call while the
   verify step scores gamma + 1 positions at once. `SpeculativeEncoderDecoderModel`
   subclasses `t5x.models.EncoderDecoderModel` and decodes with jaxspec's T5 on the
   same parameter tree (the layout of T5X's examples network).

Importing this module never imports t5x. The model class is built on first access
of `SpeculativeEncoderDecoderModel` (or a call of `make_speculative_model_class()`),
which imports `t5x.models`. The T5X-free pieces (`t5config_from_t5x_network_config`,
`sampling_config_from_t5x`, `as_drafter`, `speculative_predict`) work without it.

Gin: with T5X's `from __gin__ import dynamic_registration`, a gin file that says
`from jaxspec.integrations import t5x as t5x_adapter` can reference `@t5x_adapter.temperature_sample`
and `@t5x_adapter.SpeculativeEncoderDecoderModel()`; gin registers them then. This
module never calls gin. README.md ("Using jaxspec from T5X") has the gin lines.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import EOS_ID, T5Config, get_config
from jaxspec.decoding import common
from jaxspec.decoding.baseline import DecodingState, temperature_sample
from jaxspec.decoding.beam_search import BeamConfig, NEG_INF_VALUE, beam_search
from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig, speculative_beam_generate
from jaxspec.decoding.drafters.base import Drafter
from jaxspec.decoding.speculative import (SpeculativeConfig, check_compatible,
                                          speculative_generate)
from jaxspec.decoding.drafters.t5 import T5Drafter
from jaxspec.sampling import SamplingConfig

__all__ = ['DecodingState', 'as_drafter', 'draft_variables', 'make_speculative_model_class',
           'sampling_config_from_t5x', 'speculative_predict',
           't5config_from_t5x_network_config', 'temperature_sample', 'beam_search',
           'speculative_beam_predict']

# Fields of T5X's examples network.T5Config (t5x/examples/t5/network.py) that fix the
# architecture; dropout_rate and float32_attention_logits do not change inference
# results meaningfully and are ignored. The network's relative position buckets (32,
# max distance 128) are hard-coded there and are jaxspec's defaults.
T5X_NETWORK_FIELDS = ('vocab_size', 'emb_dim', 'num_heads', 'num_encoder_layers',
                      'num_decoder_layers', 'head_dim', 'mlp_dim', 'mlp_activations',
                      'logits_via_embedding', 'dtype')

# decoder_params keys the speculative model understands (T5X's temperature_sample names).
SUPPORTED_DECODER_PARAMS = ('temperature', 'topk', 'topp', 'max_decode_steps',
                            'max_decode_steps_hard_limit', 'decode_rng', 'eos_id',
                            'rescale_log_probs')
# T5X's callbacks edit the one-token loop's SamplingLoopState; the speculative loop
# verifies several positions per step and has no such state.
_CALLBACK_PARAMS = ('state_callback_fn', 'logit_callback_fn')


def t5config_from_t5x_network_config(cfg) -> T5Config:
  """A jaxspec T5Config from an object with T5X network.T5Config's field names.

  cfg.dtype may be a dtype (jnp.bfloat16) or its name; mlp_activations a list or tuple.
  Scanned layers (cfg.scan_layers, in later T5X networks) stack parameters on a layer
  axis, a layout jaxspec does not read, so they are refused.
  """
  missing = [name for name in T5X_NETWORK_FIELDS if not hasattr(cfg, name)]
  if missing:
    raise ValueError(f'not a T5X network config: it lacks {missing}')
  if getattr(cfg, 'scan_layers', False):
    raise ValueError('scan_layers=True stacks the layers\' parameters on one axis; '
                     'jaxspec reads the unscanned layout (layers_0, layers_1, ...)')
  return T5Config(
      vocab_size=int(cfg.vocab_size), emb_dim=int(cfg.emb_dim), num_heads=int(cfg.num_heads),
      head_dim=int(cfg.head_dim), num_encoder_layers=int(cfg.num_encoder_layers),
      num_decoder_layers=int(cfg.num_decoder_layers), mlp_dim=int(cfg.mlp_dim),
      mlp_activations=tuple(cfg.mlp_activations),
      logits_via_embedding=bool(cfg.logits_via_embedding), dtype=jnp.dtype(cfg.dtype).name)


def _python_number(name: str, value, cast):
  """value as a Python number: sampling settings select a compiled program."""
  try:
    return cast(value)
  except jax.errors.ConcretizationTypeError as error:
    raise ValueError(f'{name} must be a Python number, not a traced array: it is a '
                     'static setting of the compiled decode') from error


def sampling_config_from_t5x(temperature: float = 0.0, topk: int = 0,
                             topp: float = 0.0) -> SamplingConfig:
  """T5X's temperature_sample settings as a SamplingConfig.

  temperature <= 1e-4 is argmax; topk 0 and topp 0 disable them; at most one of the two
  may be non-zero, as in T5X.
  """
  temperature = _python_number('temperature', temperature, float)
  topk = _python_number('topk', topk, int)
  topp = _python_number('topp', topp, float)
  if topk and topp:
    raise ValueError(f'at most one of topk ({topk}) and topp ({topp}) may be non-zero')
  return SamplingConfig(temperature=temperature, top_k=topk, top_p=topp if topp > 0 else 1.0)


def as_drafter(draft, target_config: T5Config) -> Drafter:
  """A Drafter from: a Drafter; a jaxspec T5Config; the name of one (jaxspec.config,
  computed in the target's dtype); or a T5X network config (a T5 draft)."""
  if isinstance(draft, str):
    return T5Drafter(get_config(draft, dtype=target_config.dtype))
  if isinstance(draft, T5Config):
    return T5Drafter(draft)
  if isinstance(draft, Drafter):
    return draft
  if hasattr(draft, 'emb_dim'):
    return T5Drafter(t5config_from_t5x_network_config(draft))
  raise TypeError(f'cannot make a drafter from {draft!r}: pass a jaxspec Drafter, a '
                  'T5Config or its name, or a T5X network config')


def draft_variables(drafter: Drafter, draft_params):
  """The drafter's params as its `propose` takes them.

  For a T5 drafter: {'params': tree}, the bare T5X tree, or a path to a T5X checkpoint
  (read with jaxspec.checkpoints.t5x, checked against the draft config). Other
  drafters' params (n-gram tables) pass through. Leaves become device arrays.
  """
  if isinstance(drafter, T5Drafter):
    if isinstance(draft_params, (str, os.PathLike)):
      from jaxspec.checkpoints import t5x as t5x_checkpoints  # tensorstore/orbax, on use only
      draft_params = t5x_checkpoints.load_t5x_checkpoint(draft_params, drafter.config)
    if 'params' not in draft_params:
      draft_params = {'params': draft_params}
  return jax.tree_util.tree_map(jnp.asarray, draft_params)


def _sort_by_score(decodes, scores):
  """decodes [b, n, L], scores [b, n] -> both sorted ascending by score (best last)."""
  order = jnp.argsort(scores, axis=1)  # [b, n]
  return (jnp.take_along_axis(decodes, order[:, :, None], axis=1),
          jnp.take_along_axis(scores, order, axis=1))


def speculative_predict(variables, encoder_tokens, decode_length: int, rng=None, *,
                        target_config: T5Config, drafter: Drafter, drafter_params,
                        spec: SpeculativeConfig, sampling: SamplingConfig,
                        eos_id: int = EOS_ID, num_decodes: int = 1,
                        max_decode_steps: int | None = None):
  """Speculative decodes in T5X's layout: (decodes [b, n, L], scores [b, n]).

  variables: {'params': T5X tree} of the target; encoder_tokens [b, s]; L =
  decode_length. Each input is decoded n = num_decodes times (rows repeated in place,
  as T5X's flat_batch_beam_expand), each copy with its own key fold_in(rng, row).
  At most min(L, max_decode_steps) tokens are generated; the rest of L is 0. Scores are
  sums of T5X's rescaled token log-probs (0 at argmax); sorted ascending, best last.
  """
  batch = encoder_tokens.shape[0]
  steps = decode_length if max_decode_steps is None else min(decode_length, max_decode_steps)
  # T5X quirk, matched: without a decoder prompt, max_decode_steps=0 still draws one token.
  steps = max(steps, 1)
  expanded = jnp.repeat(encoder_tokens.astype(jnp.int32), num_decodes, axis=0)  # [b*n, s]
  result = speculative_generate(
      variables, drafter_params, expanded, common.row_keys(rng, batch * num_decodes),
      target_config=target_config, drafter=drafter, spec=spec, max_decode_length=steps,
      sampling=sampling, eos_id=eos_id)
  tokens = jnp.pad(result.output.tokens, ((0, 0), (0, decode_length - steps)))  # [b*n, L]
  return _sort_by_score(tokens.reshape(batch, num_decodes, decode_length),
                        result.output.log_prob.reshape(batch, num_decodes))


def _row_temperatures(temperature, batch: int):
  """A per-row temperature [batch] as a tuple of floats, or None for a scalar."""
  if np.ndim(temperature) == 0:
    return None
  try:
    values = np.asarray(temperature, np.float32)
  except jax.errors.TracerArrayConversionError as error:
    raise ValueError('a per-row temperature must be concrete (numpy or Python numbers), '
                     'not traced: each distinct value selects a compiled decode') from error
  if values.shape != (batch,):
    raise ValueError(f'temperature must be a number or one per input row, shape '
                     f'({batch},); got shape {values.shape}')
  return tuple(float(value) for value in values)


def _decode_settings(decoder_params, rng, default_sampling: SamplingConfig,
                     default_eos_id: int, batch: int, decode_length: int):
  """T5X-style decoder_params -> (sampling, eos_id, rng, max_decode_steps, temperatures).

  temperatures: None, or one float per input row (the row's standardization).
  """
  params = dict(decoder_params or {})
  callbacks = sorted(set(params) & set(_CALLBACK_PARAMS))
  if callbacks:
    raise ValueError(f'{callbacks} are not supported by speculative decoding: T5X\'s '
                     'callbacks edit the one-token loop state, which the speculative loop '
                     'does not have; use t5x_adapter.temperature_sample as decode_fn')
  unknown = sorted(set(params) - set(SUPPORTED_DECODER_PARAMS))
  if unknown:
    raise ValueError(f'decoder_params {unknown} are not supported by speculative '
                     f'decoding; supported: {list(SUPPORTED_DECODER_PARAMS)}')
  if not params.get('rescale_log_probs', True):
    raise ValueError('rescale_log_probs=False is not supported: speculative scores are '
                     'log-probs under the adjusted (temperature/top-k/top-p) distribution')
  if rng is not None and params.get('decode_rng') is not None:
    raise ValueError("got an RNG both as `rng` and as decoder_params['decode_rng']; "
                     'pass one or the other')
  temperature = params.get('temperature', default_sampling.temperature)
  temperatures = _row_temperatures(temperature, batch)
  sampling = sampling_config_from_t5x(
      temperature if temperatures is None else 1.0,
      params.get('topk', default_sampling.top_k),
      params.get('topp', default_sampling.top_p if default_sampling.top_p < 1.0 else 0.0))
  max_steps = params.get('max_decode_steps')
  hard_limit = params.get('max_decode_steps_hard_limit')
  if max_steps is not None:
    max_steps = _python_number('max_decode_steps', max_steps, int)
    # As T5X: the hard limit only clips an explicit max_decode_steps, and only when > 0.
    if hard_limit is not None and hard_limit > 0:
      max_steps = min(max_steps, _python_number('max_decode_steps_hard_limit', hard_limit, int))
    if max_steps > decode_length:
      raise ValueError(f'max_decode_steps ({max_steps}) exceeds the decode length '
                       f'{decode_length}')
  eos_id = _python_number('eos_id', params.get('eos_id', default_eos_id), int)
  return (sampling, eos_id, rng if rng is not None else params.get('decode_rng'), max_steps,
          temperatures)


def _predict_per_row_temperature(predict, sampling: SamplingConfig, temperatures):
  """Rows at different temperatures: one speculative decode per distinct temperature
  (every row standardized at its own), each row taken from its temperature's decode.

  predict(sampling=...) -> (decodes [b, n, L], scores [b, n]); temperatures: b floats.
  Rows decode independently (per-row keys), so running a row at another temperature
  does not change what it draws at its own.
  """
  decodes = scores = None
  for temperature in sorted(set(temperatures)):
    row = jnp.asarray(np.array(temperatures) == temperature)  # [b]
    these_decodes, these_scores = predict(
        sampling=dataclasses.replace(sampling, temperature=temperature))
    if decodes is None:
      decodes, scores = these_decodes, these_scores
    else:
      decodes = jnp.where(row[:, None, None], these_decodes, decodes)
      scores = jnp.where(row[:, None], these_scores, scores)
  return decodes, scores


# decoder_params the speculative beam route understands (T5X's beam_search names).
SUPPORTED_BEAM_DECODER_PARAMS = ('alpha', 'max_decode_step', 'min_log_prob', 'eos_id',
                                 'decode_rng')


def speculative_beam_predict(variables, encoder_tokens, decode_length: int, *,
                             target_config: T5Config, drafter: Drafter, drafter_params,
                             gamma: int, draft_beams: int, alpha: float, num_decodes: int,
                             decoder_params=None, eos_id: int = EOS_ID):
  """Speculative beam search in T5X's layout: (decodes [b, beams, L], scores [b, beams]).

  num_decodes is the beam width, as for T5X's beam_search; decoder_params may set
  alpha, max_decode_step, min_log_prob, eos_id (decode_rng is unused, as in T5X).
  The output is jaxspec's beam_search's, best last.
  """
  params = dict(decoder_params or {})
  unknown = sorted(set(params) - set(SUPPORTED_BEAM_DECODER_PARAMS))
  if unknown:
    raise ValueError(f'decoder_params {unknown} are not supported by speculative beam '
                     f'search; supported: {list(SUPPORTED_BEAM_DECODER_PARAMS)}')
  if not isinstance(drafter, T5Drafter):
    raise ValueError('speculative beam search drafts by beam search with a T5 draft model; '
                     f'got {type(drafter).__name__}')
  beam = BeamConfig(
      num_beams=int(num_decodes), alpha=_python_number('alpha', params.get('alpha', alpha), float),
      max_decode_step=_python_number('max_decode_step', params.get('max_decode_step', -1), int),
      min_log_prob=_python_number('min_log_prob', params.get('min_log_prob', NEG_INF_VALUE),
                                  float))
  result = speculative_beam_generate(
      variables, drafter_params, encoder_tokens, target_config=target_config,
      draft_config=drafter.config, beam=beam,
      spec=SpeculativeBeamConfig(gamma=gamma, draft_beams=draft_beams),
      max_decode_length=decode_length,
      eos_id=_python_number('eos_id', params.get('eos_id', eos_id), int))
  return result.output.tokens, result.output.scores


def _model_class(base: type) -> type:
  """SpeculativeEncoderDecoderModel as a subclass of `base` (t5x's EncoderDecoderModel)."""

  class SpeculativeEncoderDecoderModel(base):
    """T5X's EncoderDecoderModel, predicting by speculative decoding with a draft.

    Constructor: T5X's arguments (module, input_vocabulary, output_vocabulary,
    optimizer_def, then keywords such as decode_fn, z_loss, ... passed through), and:
      draft: a jaxspec Drafter, a jaxspec T5Config or its name, or a T5X network config.
      draft_params: the draft's params ({'params': tree}, the bare T5X tree, a T5X
        checkpoint path, or an n-gram drafter's table).
      gamma, lenience, verification: SpeculativeConfig (lenience 1 is exact; < 1 changes
        outputs; verification 'token', 'block' or 'coupled').
      temperature, topk, topp: default sampling (T5X's names), overridden per call by
        decoder_params; the default is argmax.
      target_config: a jaxspec T5Config for the target; default: from module.config.
      decoder: 'sample' (default: speculative sampling, argmax by default) or 'beam'
        (speculative beam search equal to jaxspec's beam_search: num_decodes beams, the
        draft's beam width draft_beams (0: twice num_decodes), brevity penalty alpha).
    Training, scoring and evaluation are T5X's, unchanged.
    """

    def __init__(self, module, input_vocabulary, output_vocabulary, optimizer_def, *,
                 draft, draft_params, gamma: int = 4, lenience: float = 1.0,
                 verification: str = 'token',
                 temperature: float = 0.0, topk: int = 0, topp: float = 0.0,
                 target_config: T5Config | None = None, decoder: str = 'sample',
                 alpha: float = 0.6, draft_beams: int = 0, **kwargs):
      super().__init__(module=module, input_vocabulary=input_vocabulary,
                       output_vocabulary=output_vocabulary, optimizer_def=optimizer_def,
                       **kwargs)
      self.target_config = target_config or t5config_from_t5x_network_config(module.config)
      self.drafter = as_drafter(draft, self.target_config)
      check_compatible(self.target_config, self.drafter)
      self.drafter_params = draft_variables(self.drafter, draft_params)
      self.spec = SpeculativeConfig(gamma=gamma, lenience=lenience,
                                    verification=verification)
      self.default_sampling = sampling_config_from_t5x(temperature, topk, topp)
      if decoder not in ('sample', 'beam'):
        raise ValueError(f"decoder must be 'sample' or 'beam', got {decoder!r}")
      self.decoder, self.alpha, self.draft_beams = decoder, alpha, draft_beams

    def predict_batch_with_aux(self, params, batch, rng=None, decoder_params=None,
                               return_all_decodes=None, num_decodes=None,
                               prompt_with_targets=False, flax_mutables=None):
      """T5X's signature: (decodes [B, L], {'scores': [B]}), or [B, n, L] and [B, n].

      batch['encoder_input_tokens'] [B, S]; batch['decoder_input_tokens'] [B, L] sets
      the decode length L. `flax_mutables`, passed by later T5X versions, must be empty.
      """
      defaults = getattr(self, '_default_decoder_params', None)
      if return_all_decodes is None:
        return_all_decodes = getattr(defaults, 'return_all_decodes', False)
      if num_decodes is None:
        num_decodes = getattr(defaults, 'num_decodes', 1)
      if prompt_with_targets:
        raise NotImplementedError('prompt_with_targets: speculative decoding starts from '
                                  'the start token; forced decoder prompts are unsupported')
      if flax_mutables:
        raise ValueError('flax_mutables are not supported: jaxspec\'s T5 has only params')
      if self.decoder == 'beam':
        decodes, scores = speculative_beam_predict(
            {'params': params}, batch['encoder_input_tokens'],
            batch['decoder_input_tokens'].shape[1], target_config=self.target_config,
            drafter=self.drafter, drafter_params=self.drafter_params, gamma=self.spec.gamma,
            draft_beams=self.draft_beams, alpha=self.alpha, num_decodes=int(num_decodes),
            decoder_params=decoder_params, eos_id=self.output_vocabulary.eos_id or 1)
        if return_all_decodes:
          return decodes, {'scores': scores}
        return decodes[:, -1], {'scores': scores[:, -1]}
      encoder_tokens = batch['encoder_input_tokens']
      decode_length = batch['decoder_input_tokens'].shape[1]
      # As T5X: a vocabulary without EOS (eos_id None, e.g. seqio's PassThroughVocabulary)
      # ends sequences at id 1.
      sampling, eos_id, decode_rng, max_steps, temperatures = _decode_settings(
          decoder_params, rng, self.default_sampling, self.output_vocabulary.eos_id or 1,
          encoder_tokens.shape[0], decode_length)
      predict = functools.partial(
          speculative_predict, {'params': params}, encoder_tokens, decode_length,
          decode_rng, target_config=self.target_config, drafter=self.drafter,
          drafter_params=self.drafter_params, spec=self.spec, eos_id=eos_id,
          num_decodes=int(num_decodes), max_decode_steps=max_steps)
      if temperatures is None:
        decodes, scores = predict(sampling=sampling)
      else:
        decodes, scores = _predict_per_row_temperature(predict, sampling, temperatures)
      if return_all_decodes:
        return decodes, {'scores': scores}
      return decodes[:, -1], {'scores': scores[:, -1]}

  # Found by name here (module __getattr__), for gin selectors and pickling.
  SpeculativeEncoderDecoderModel.__module__ = __name__
  SpeculativeEncoderDecoderModel.__qualname__ = 'SpeculativeEncoderDecoderModel'
  return SpeculativeEncoderDecoderModel


@functools.cache
def make_speculative_model_class() -> type:
  """Imports t5x.models and returns SpeculativeEncoderDecoderModel (built once)."""
  try:
    from t5x import models  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(
        'jaxspec.integrations.t5x.SpeculativeEncoderDecoderModel subclasses '
        't5x.models.EncoderDecoderModel and needs t5x installed (pip install t5x, see '
        'github.com/google-research/t5x); t5x could not be imported: '
        f'{error}') from error
  return _model_class(models.EncoderDecoderModel)


def __getattr__(name: str) -> Any:
  """Builds SpeculativeEncoderDecoderModel on first access (PEP 562): the import of t5x
  happens then, not when this module is imported."""
  if name == 'SpeculativeEncoderDecoderModel':
    return make_speculative_model_class()
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')

"""The T5X drop-in against a REAL t5x install (google-research/t5x).

CI installs t5x from ../shared/vendor (install-t5x.sh) where that folder exists; without
t5x every test here is skipped, saying so. References are T5X's own code: its
`decoding.temperature_sample`, its EncoderDecoderModel with the examples network
(t5x/examples/t5/network.py, a tiny config with random params), its `score_batch`
(teacher-forced log-probs of its network) and its `utils.get_infer_fn` with a
PjitPartitioner.
"""

import functools

import flax.core
import jax
import jax.numpy as jnp
import numpy as np
import pytest

t5x_decoding = pytest.importorskip(
    't5x.decoding', reason='t5x is not installed, so jaxspec is not compared with it here: '
    'install it with `bash ../shared/vendor/install-t5x.sh` (CI does)')

from t5x import models, partitioning, utils  # noqa: E402  pylint: disable=g-import-not-at-top
from t5x.examples.t5 import network  # noqa: E402  pylint: disable=g-import-not-at-top
import seqio  # noqa: E402  pylint: disable=g-import-not-at-top

from jaxspec.integrations import t5x as t5x_adapter  # noqa: E402
from jaxspec.checkpoints import t5x as t5x_checkpoints  # noqa: E402
from jaxspec.decoding import baseline  # noqa: E402

EOS = 1

# ---------------------------------------------------------------------------
# temperature_sample against T5X's, argument by argument.

VOCAB = 7


def _table_decoder(batch: int, layers: int = 0):
  """(cache, tokens_to_logits): next-token logits from a table, a per-row cache leaf
  that changes every step and a cache_index leaf, so the cache layout shows in the
  output. layers > 0 puts a scanned-layers axis before the batch axis."""
  rng = np.random.RandomState(0)
  table = jnp.asarray(rng.randn(VOCAB, VOCAB).astype(np.float32) * 2.0)
  bias = rng.randn(batch, VOCAB).astype(np.float32)
  index_shape = (batch,) if layers == 0 else (layers, batch)
  cache = {'decoder': {'bias': jnp.asarray(bias if layers == 0 else np.stack([bias] * layers)),
                       'cache_index': jnp.zeros(index_shape, jnp.int32)}}

  def tokens_to_logits(state):
    decoder = state.cache['decoder']
    bias = decoder['bias'] if layers == 0 else decoder['bias'][0]
    logits = table[state.cur_token[:, 0]] + bias + 0.1 * state.cur_index[:, None]
    return logits, {'decoder': {'bias': decoder['bias'] * 0.9,
                                'cache_index': decoder['cache_index'] + 1}}
  return cache, tokens_to_logits


def _force_six_at_step_one(state):
  sequences = state.sequences.at[:, 4].set(
      jnp.where(state.step == 1, 6, state.sequences[:, 4]))
  return state.replace(sequences=sequences)


def _favour_two_on_odd_steps(logits, state):
  return logits.at[:, 2].add(3.0 * (state.step % 2))


INPUTS = np.array([[0, 5, 2, 6, 1, 0, 0], [0, 3, 0, 0, 0, 0, 0], [0, 4, 1, 0, 0, 0, 0]],
                  np.int32)
INITIAL_INDEX = np.array([4, 1, 2], np.int32)
CASES = {
    'greedy': dict(temperature=0.0),
    'sampled': dict(temperature=1.0, topk=0),
    'topk': dict(temperature=0.7, topk=3, num_decodes=2),
    'topp': dict(temperature=1.2, topk=0, topp=0.8),
    'per-row temperature': dict(temperature=np.array([0.0, 1.0, 2.0]), topk=0, num_decodes=3),
    'raw scores': dict(temperature=1.0, topk=0, num_decodes=4, rescale_log_probs=False),
    'max_decode_steps': dict(temperature=1.0, topk=0, max_decode_steps=2),
    'max_decode_steps 0': dict(temperature=1.0, topk=0, max_decode_steps=0),
    'hard limit': dict(temperature=1.0, topk=0, max_decode_steps=5,
                       max_decode_steps_hard_limit=1),
    'initial_index': dict(temperature=1.0, topk=0, num_decodes=2, initial_index=INITIAL_INDEX,
                          max_decode_steps=3),
    'callbacks': dict(temperature=1.0, topk=0, num_decodes=2,
                      state_callback_fn=_force_six_at_step_one,
                      logit_callback_fn=_favour_two_on_odd_steps),
    'scanned cache, prefilled': dict(temperature=0.5, topk=0, num_decodes=2, cache_offset=1,
                                     initial_index=INITIAL_INDEX),
}


def _both(arguments, layers=0, inputs=INPUTS, transform=lambda fn: fn):
  results = []
  for sample in (t5x_decoding.temperature_sample, baseline.temperature_sample):
    cache, tokens_to_logits = _table_decoder(inputs.shape[0], layers)
    results.append(transform(functools.partial(
        sample, jnp.asarray(inputs), cache, tokens_to_logits, EOS,
        decode_rng=jax.random.PRNGKey(3)))(**arguments))
  return results


@pytest.mark.parametrize('name', list(CASES))
def test_temperature_sample_equals_t5x(name):
  arguments = dict(CASES[name])
  layers = arguments.get('cache_offset', 0)
  (t5x_decodes, t5x_scores), (decodes, scores) = _both(arguments, layers)
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(t5x_decodes))
  np.testing.assert_allclose(np.asarray(scores), np.asarray(t5x_scores), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('settings', [(1.0, 2, 0.0), (0.6, 0, 0.7), (1.0, 0, 0.0),
                                      (np.array([0.0, 0.5, 1.5]), 0, 0.9)])
def test_traced_settings_equal_t5x(settings):
  """temperature, topk, topp traced under jit (a traced topp of 0: T5X masks every token)."""
  temperature, topk, topp = settings

  def traced(sample):
    return jax.jit(lambda t, k, p: sample(temperature=t, topk=k, topp=p))(
        temperature, topk, topp)
  (t5x_decodes, t5x_scores), (decodes, scores) = _both({}, transform=lambda fn: (
      lambda: traced(fn)))
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(t5x_decodes))
  np.testing.assert_allclose(np.asarray(scores), np.asarray(t5x_scores), rtol=1e-6, atol=1e-6)


def test_topk_and_topp_together_refused_like_t5x():
  for sample in (t5x_decoding.temperature_sample, baseline.temperature_sample):
    cache, tokens_to_logits = _table_decoder(3)
    with pytest.raises(ValueError, match='(?i)at most one of'):
      sample(jnp.asarray(INPUTS), cache, tokens_to_logits, EOS, topk=2, topp=0.5)


# ---------------------------------------------------------------------------
# T5X's EncoderDecoderModel and examples network.

NETWORK = network.T5Config(vocab_size=16, emb_dim=8, num_heads=2, num_encoder_layers=2,
                           num_decoder_layers=2, head_dim=4, mlp_dim=16,
                           mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
DRAFT_NETWORK = network.T5Config(vocab_size=16, emb_dim=8, num_heads=2, num_encoder_layers=1,
                                 num_decoder_layers=1, head_dim=4, mlp_dim=8,
                                 mlp_activations=('relu',), dropout_rate=0.0)
ENCODER_TOKENS = np.array([[5, 6, 7, 8, 9, EOS], [9, 10, 11, EOS, 0, 0],
                           [3, 4, EOS, 0, 0, 0]], np.int32)
LENGTH = 6
# seqio's PassThroughVocabulary has eos_id None; T5X then ends sequences at id 1.
VOCABULARY = seqio.PassThroughVocabulary(size=16)


def _model(config=NETWORK, cls=models.EncoderDecoderModel, **kwargs):
  return cls(module=network.Transformer(config), input_vocabulary=VOCABULARY,
             output_vocabulary=VOCABULARY, optimizer_def=None, **kwargs)


def _input_shapes(batch):
  return {'encoder_input_tokens': (batch, ENCODER_TOKENS.shape[1]),
          'decoder_input_tokens': (batch, LENGTH)}


def _init(model, seed):
  return model.get_initial_variables(jax.random.PRNGKey(seed), _input_shapes(1))['params']


@pytest.fixture(scope='module')
def params():
  """(target params, draft params): T5X's own initialization of its network."""
  return _init(_model(), 0), _init(_model(DRAFT_NETWORK), 1)


def _batch(decoder_tokens=None):
  decoder_tokens = (np.zeros((3, LENGTH), np.int32) if decoder_tokens is None
                    else decoder_tokens)
  return {'encoder_input_tokens': jnp.asarray(ENCODER_TOKENS),
          'decoder_input_tokens': jnp.asarray(decoder_tokens),
          'decoder_target_tokens': jnp.asarray(decoder_tokens)}


def _speculative(params, gamma=3, **kwargs):
  return _model(cls=t5x_adapter.SpeculativeEncoderDecoderModel, draft=DRAFT_NETWORK,
                draft_params=params[1], gamma=gamma, **kwargs)


def _predict(model, params, decoder_tokens=None, decoder_params=None, jit=True, **kwargs):
  """model.predict_batch_with_aux, jitted as T5X runs it. The speculative model's decode
  is jitted inside, so unjitted calls share its compiled programs across tests."""
  # A fresh decoder_params per call: T5X adds its own entries to the dict it is given.
  predict = lambda p, rng: model.predict_batch_with_aux(
      p, _batch(decoder_tokens), rng=rng, decoder_params=dict(decoder_params or {}),
      **kwargs)
  return (jax.jit(predict) if jit else predict)(params, jax.random.PRNGKey(5))


@pytest.mark.parametrize('request_kwargs', [
    dict(decoder_params={'temperature': 0.0}),
    dict(decoder_params={'temperature': 1.0, 'topk': 0}, num_decodes=3,
         return_all_decodes=True),
    dict(decoder_params={'temperature': 1.0, 'topk': 0, 'max_decode_steps': 2},
         prompt_with_targets=True,
         decoder_tokens=np.array([[0, 4, 5, 0, 0, 0], [0, 0, 0, 0, 0, 0],
                                  [0, 7, 8, 9, 0, 0]], np.int32)),
], ids=['greedy', 'sampled, num_decodes 3', 'decoder prompts'])
def test_decode_fn_in_t5x_model_equals_stock_t5x(params, request_kwargs):
  stock = _model(decode_fn=t5x_decoding.temperature_sample)
  ours = _model(decode_fn=t5x_adapter.temperature_sample)
  expected, expected_aux = _predict(stock, params[0], **dict(request_kwargs))
  decodes, aux = _predict(ours, params[0], **dict(request_kwargs))
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(expected))
  np.testing.assert_allclose(np.asarray(aux['scores']), np.asarray(expected_aux['scores']),
                             rtol=1e-6, atol=1e-6)


def _t5x_scores(model, params, decodes):
  """T5X's score_batch (teacher forced, its network) of decodes [b, L] up to the first EOS."""
  decodes = np.asarray(decodes)
  is_eos = decodes == EOS
  lengths = np.where(is_eos.any(1), is_eos.argmax(1) + 1, decodes.shape[1])  # [b]
  copies = decodes.shape[0] // ENCODER_TOKENS.shape[0]
  batch = {'encoder_input_tokens': jnp.asarray(np.repeat(ENCODER_TOKENS, copies, axis=0)),
           'decoder_input_tokens': jnp.asarray(np.pad(decodes, ((0, 0), (1, 0)))[:, :-1]),
           'decoder_target_tokens': jnp.asarray(decodes),
           'decoder_loss_weights': jnp.asarray(
               np.arange(decodes.shape[1])[None, :] < lengths[:, None], jnp.float32)}
  return np.asarray(model.score_batch(params, batch))


def test_speculative_model_greedy_equals_stock_t5x(params):
  stock = _model(decode_fn=t5x_decoding.temperature_sample)
  expected, _ = _predict(stock, params[0], decoder_params={'temperature': 0.0})
  decodes, aux = _predict(_speculative(params), params[0], jit=False)
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(expected))
  np.testing.assert_array_equal(np.asarray(aux['scores']), 0.0)  # rescaled argmax, as T5X


def test_speculative_model_sampled_scores_are_t5x_log_probs(params):
  model = _speculative(params)
  decodes, aux = _predict(model, params[0], decoder_params={'temperature': 1.0},
                          num_decodes=3, return_all_decodes=True, jit=False)
  decodes, scores = np.asarray(decodes), np.asarray(aux['scores'])
  assert decodes.shape == (3, 3, LENGTH) and np.all(np.diff(scores, axis=1) >= 0)
  np.testing.assert_allclose(scores.reshape(-1),
                             _t5x_scores(model, params[0], decodes.reshape(9, LENGTH)),
                             rtol=1e-4, atol=1e-4)


def test_speculative_model_samples_the_t5x_networks_distribution(params):
  """Two-token outputs of one input: counts against T5X's teacher-forced probabilities."""
  samples, length = 4000, 2
  model = _speculative(params, gamma=1)
  batch = {'encoder_input_tokens': jnp.asarray(ENCODER_TOKENS[:1]),
           'decoder_input_tokens': jnp.zeros((1, length), jnp.int32)}
  decodes, _ = jax.jit(lambda p: model.predict_batch_with_aux(
      p, batch, rng=jax.random.PRNGKey(11), decoder_params={'temperature': 1.0},
      num_decodes=samples, return_all_decodes=True))(params[0])
  decodes = np.asarray(decodes)[0]  # [samples, 2]
  # Exact: p(t1) p(t2 | t1), and p(EOS) alone (the sequence ends there).
  vocab = NETWORK.vocab_size
  stock = _model()
  first_inputs = np.stack([np.zeros(vocab, np.int32), np.arange(vocab)], axis=1)  # [v, 2]
  # Targets all 1: T5X's network masks attention at positions whose target token is 0.
  logits = stock.module.apply({'params': params[0]}, jnp.asarray(np.repeat(
      ENCODER_TOKENS[:1], vocab, axis=0)), jnp.asarray(first_inputs), jnp.ones_like(
          jnp.asarray(first_inputs)), enable_dropout=False)  # [v, 2, v]
  probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), np.float64)
  first = probs[0, 0]  # [v]
  exact = first[:, None] * probs[:, 1]  # [v, v]
  exact[EOS] = 0.0
  exact[EOS, 0] = first[EOS]
  counts = np.zeros((vocab, vocab))
  np.add.at(counts, (decodes[:, 0], decodes[:, 1]), 1)
  expected = exact.reshape(-1) * samples
  observed = counts.reshape(-1)
  assert observed[expected == 0].sum() == 0
  big = expected >= 5  # cells expected below 5 are pooled
  expected_cells = np.append(expected[big], expected[~big & (expected > 0)].sum())
  observed_cells = np.append(observed[big], observed[~big & (expected > 0)].sum())
  chi_square = np.sum((observed_cells - expected_cells) ** 2 / np.maximum(expected_cells, 1e-9))
  dof = len(expected_cells) - 1
  # 99.9% quantile of chi-square, Wilson-Hilferty approximation.
  quantile = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3
  assert chi_square < quantile, (chi_square, dof)


def test_speculative_model_refusals_and_per_row_temperature(params):
  model = _speculative(params)
  assert _speculative(params, verification='coupled').spec.verification == 'coupled'
  with pytest.raises(ValueError, match='verification must be one of'):
    _speculative(params, verification='tree')
  with pytest.raises(ValueError, match='state_callback_fn.*not supported'):
    model.predict_batch_with_aux(params[0], _batch(),
                                 decoder_params={'state_callback_fn': lambda s: s})
  with pytest.raises(ValueError, match='max_decode_steps .* exceeds the decode length'):
    model.predict_batch_with_aux(params[0], _batch(), decoder_params={'max_decode_steps': 9})
  # Per-row temperature: each row decodes as it would with its temperature for all rows.
  temperatures = np.array([1.0, 0.0, 1.0])
  mixed, _ = _predict(model, params[0], decoder_params={'temperature': temperatures},
                      jit=False)
  sampled, _ = _predict(model, params[0], decoder_params={'temperature': 1.0}, jit=False)
  greedy, _ = _predict(model, params[0], decoder_params={'temperature': 0.0}, jit=False)
  np.testing.assert_array_equal(np.asarray(mixed),
                                np.where(temperatures[:, None] > 0, sampled, greedy))


def test_infer_fn_with_pjit_partitioner_equals_stock_t5x(params, tmp_path):
  """T5X's inference path: a PjitPartitioner, a train state restored from a T5X checkpoint
  written by T5X, utils.get_infer_fn over a tf.data set of 5 examples (batch 3, padded)."""
  tf = pytest.importorskip('tensorflow')
  from t5x import checkpoints  # pylint: disable=g-import-not-at-top
  partitioner = partitioning.PjitPartitioner(num_partitions=1)
  sampled = functools.partial(t5x_decoding.temperature_sample, temperature=1.0, topk=0)
  stock = _model(decode_fn=sampled)
  initializer = utils.TrainStateInitializer(
      optimizer_def=None, init_fn=stock.get_initial_variables, input_shapes=_input_shapes(3),
      partitioner=partitioner)
  train_state = initializer.from_scratch(jax.random.PRNGKey(0)).replace_params(params[0])
  checkpoints.Checkpointer(train_state, partitioner, str(tmp_path)).save(train_state)
  written = t5x_checkpoints.find_t5x_checkpoint(tmp_path).item
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         t5x_checkpoints.load_t5x_checkpoint(written),
                         flax.core.unfreeze(jax.tree_util.tree_map(np.asarray, params[0])))
  encoder_tokens = np.concatenate([ENCODER_TOKENS, ENCODER_TOKENS[:2, ::-1]])
  dataset = tf.data.Dataset.from_tensor_slices({
      'encoder_input_tokens': encoder_tokens,
      'decoder_input_tokens': np.zeros((5, LENGTH), np.int32)}).enumerate()

  def infer(model, rng=None):
    infer_fn = utils.get_infer_fn(model.predict_batch, batch_size=3,
                                  train_state_axes=initializer.train_state_axes,
                                  partitioner=partitioner)
    return np.stack([prediction for _, prediction in infer_fn(dataset, train_state, rng)])

  rng = jax.random.PRNGKey(2)
  ours = _model(decode_fn=functools.partial(t5x_adapter.temperature_sample, temperature=1.0,
                                            topk=0))
  np.testing.assert_array_equal(infer(ours, rng), infer(stock, rng))
  greedy = _model(decode_fn=functools.partial(t5x_decoding.temperature_sample,
                                              temperature=0.0))
  # The target drafts for itself here, its params read from T5X's msgpack file.
  speculative = _model(cls=t5x_adapter.SpeculativeEncoderDecoderModel, draft=NETWORK,
                       draft_params=written, gamma=2)
  np.testing.assert_array_equal(infer(speculative), infer(greedy))

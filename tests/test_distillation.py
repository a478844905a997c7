"""jaxspec.training.distillation: divergences against numpy and analytic gradients, on-policy
batches against direct decodes of the right model, training that raises the measured
alpha, and scripts/train.py's distillation runs resuming exactly."""

import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import rel_entr

from jaxspec.measure import benchmark
from jaxspec.training import distillation, core as training
from jaxspec.checkpoints.t5x import load_t5x_checkpoint, save_t5x_checkpoint
from jaxspec.config import EOS_ID, get_config
from jaxspec.data import corpora
from jaxspec.decoding import baseline
from jaxspec.decoding.drafters.t5 import T5Drafter
from jaxspec.model import T5, init_params
from jaxspec.sampling import SamplingConfig
from jaxspec.decoding.verification.token import acceptance_rate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import gin_flags
from jaxspec.launch import train as train_script

TEACHER = get_config('test_tiny_1_1')  # vocab 64
DRAFT = TEACHER.replace(emb_dim=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                        mlp_dim=32)


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _reference_divergence(name, teacher_logits, draft_logits, temperature, beta):
  """numpy float64, straight from the definitions (scipy's rel_entr for KL terms)."""
  if temperature == 0.0:
    p = np.eye(teacher_logits.shape[-1])[np.argmax(teacher_logits, axis=-1)]
    q = _softmax(draft_logits)
  else:
    p, q = _softmax(teacher_logits / temperature), _softmax(draft_logits / temperature)
  if name == 'forward_kl':
    return rel_entr(p, q).sum(-1)
  if name == 'reverse_kl':
    return rel_entr(q, p).sum(-1)
  if name == 'jsd':
    m = beta * p + (1 - beta) * q
    return beta * rel_entr(p, m).sum(-1) + (1 - beta) * rel_entr(q, m).sum(-1)
  return 0.5 * np.abs(p - q).sum(-1)


def _random_logits(seed, shape=(3, 5, 11), scale=3.0):
  rng = np.random.RandomState(seed)
  return (scale * rng.randn(*shape)).astype(np.float32), (scale * rng.randn(*shape)).astype(
      np.float32)


CASES = [(name, temperature) for name in distillation.DIVERGENCES
         for temperature in (1.0, 0.5, 0.0) if not (name == 'reverse_kl' and temperature == 0)]


@pytest.mark.parametrize('name,temperature', CASES)
def test_divergence_matches_numpy(name, temperature):
  teacher_logits, draft_logits = _random_logits(0)
  for beta in ((0.2, 0.5, 0.9) if name == 'jsd' else (0.5,)):
    config = distillation.DivergenceConfig(name=name, temperature=temperature, beta=beta)
    actual = distillation.position_divergence(teacher_logits, draft_logits, config)
    expected = _reference_divergence(name, teacher_logits, draft_logits, temperature, beta)
    assert actual.shape == (3, 5)
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-6)
  # A divergence of a distribution from itself is 0 (at T=0 only q = one-hot p would be).
  if temperature > 0:
    np.testing.assert_allclose(
        distillation.position_divergence(draft_logits, draft_logits, config), 0.0, atol=1e-6)


def _analytic_gradient(name, teacher_logits, draft_logits, temperature):
  """d D / d draft_logits, numpy float64, for softmax q = softmax(z / T)."""
  p, q = _softmax(teacher_logits / temperature), _softmax(draft_logits / temperature)
  if name == 'forward_kl':
    return (q - p) / temperature
  if name == 'reverse_kl':
    log_ratio = np.log(q) - np.log(p)
    return q * (log_ratio - (q * log_ratio).sum(-1, keepdims=True)) / temperature
  sign = np.sign(q - p)  # tvd: 0.5 sum_i sign(q_i - p_i) dq_i/dz_j
  return 0.5 * q * (sign - (sign * q).sum(-1, keepdims=True)) / temperature


@pytest.mark.parametrize('name', ['forward_kl', 'reverse_kl', 'tvd'])
def test_gradient_matches_analytic_and_is_finite_where_p_equals_q(name):
  teacher_logits, draft_logits = _random_logits(1, shape=(4, 9))
  config = distillation.DivergenceConfig(name=name, temperature=0.7)
  grad_fn = jax.grad(lambda z, t: jnp.sum(distillation.position_divergence(t, z, config)))
  np.testing.assert_allclose(grad_fn(draft_logits, teacher_logits),
                             _analytic_gradient(name, teacher_logits, draft_logits, 0.7),
                             rtol=1e-4, atol=1e-6)
  # Where q == p exactly, |p - q| has a kink: the subgradient must be finite (0 here).
  at_tie = grad_fn(teacher_logits, teacher_logits)
  assert np.all(np.isfinite(at_tie))
  np.testing.assert_allclose(at_tie, 0.0, atol=1e-6)


def test_tvd_is_what_alpha_rewards():
  teacher_logits, draft_logits = _random_logits(2)
  # Temperature 1: TV = 1 - beta, beta = sum min(p, q) (Theorem 3.5).
  tvd = distillation.position_divergence(teacher_logits, draft_logits,
                                         distillation.DivergenceConfig(name='tvd'))
  beta = acceptance_rate(jax.nn.softmax(teacher_logits), jax.nn.softmax(draft_logits))
  np.testing.assert_allclose(tvd, 1.0 - beta, rtol=1e-5, atol=1e-6)
  # Temperature 0: 1 - q(teacher's argmax), the draft's probability of agreeing.
  greedy = distillation.position_divergence(
      teacher_logits, draft_logits, distillation.DivergenceConfig(name='tvd', temperature=0.0))
  q = _softmax(draft_logits)
  expected = 1.0 - np.take_along_axis(q, np.argmax(teacher_logits, -1)[..., None], -1)[..., 0]
  np.testing.assert_allclose(greedy, expected, rtol=1e-5, atol=1e-6)


def test_bad_configs_are_refused_by_name():
  with pytest.raises(ValueError, match='divergence must be one of'):
    distillation.DivergenceConfig(name='kl')
  with pytest.raises(ValueError, match='reverse_kl is infinite'):
    distillation.DivergenceConfig(name='reverse_kl', temperature=0.0)
  with pytest.raises(ValueError, match='beta must be in'):
    distillation.DivergenceConfig(name='jsd', beta=1.0)
  with pytest.raises(ValueError, match='shares must be >= 0'):
    distillation.DataMixConfig(draft_samples=-0.5)
  with pytest.raises(ValueError, match='positive sum'):
    distillation.DataMixConfig(references=0.0)


def test_batch_sources_follow_the_shares_and_depend_only_on_seed_and_step():
  mix = distillation.DataMixConfig(draft_samples=0.5, target_samples=0.0, target_greedy=0.3,
                                   references=0.2)
  sources = [distillation.batch_source(mix, 3, step) for step in range(3000)]
  assert sources == [distillation.batch_source(mix, 3, step) for step in range(3000)]
  assert sources != [distillation.batch_source(mix, 4, step) for step in range(3000)]
  counts = {name: sources.count(name) / len(sources) for name in distillation.SOURCES}
  assert counts['target_samples'] == 0.0
  # Binomial standard deviation at 3000 draws is below 0.01; allow 4 of them.
  for name, share in (('draft_samples', 0.5), ('target_greedy', 0.3), ('references', 0.2)):
    assert abs(counts[name] - share) < 0.04, (name, counts)


@pytest.fixture(scope='module')
def tiny_pair():
  teacher = init_params(TEACHER, jax.random.PRNGKey(0))['params']
  draft = init_params(DRAFT, jax.random.PRNGKey(1))['params']
  return teacher, draft


ROWS, MAX_DECODE_LENGTH = 8, 16  # One batch shape for every decode below: few compiles.


def _inputs(seed, rows=ROWS, length=12):
  tokens = np.random.RandomState(seed).randint(3, TEACHER.vocab_size, (rows, length))
  tokens[:, -1] = EOS_ID
  tokens[0, 7:] = 0  # One padded row.
  tokens[0, 6] = EOS_ID
  return tokens.astype(np.int32)


def _on_policy_batch(reference, source, rng, tiny_pair, draft=None, temperature=1.0):
  teacher, initial_draft = tiny_pair
  return distillation.on_policy_batch(
      reference, source, rng, mix=distillation.DataMixConfig(temperature=temperature),
      max_decode_length=MAX_DECODE_LENGTH,
      draft_params={'params': initial_draft if draft is None else draft}, draft_config=DRAFT,
      teacher_params={'params': teacher}, teacher_config=TEACHER)


def test_noised_inputs_swap_pieces_at_the_rate_and_keep_padding_and_eos():
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, 8000, (64, 40)).astype(np.int32)
  inputs[:, 30] = EOS_ID
  inputs[:, 31:] = 0
  noised = distillation.noised_inputs(inputs, 0.25, 8000, seed=1, step=7)
  np.testing.assert_array_equal(noised[:, 30:], inputs[:, 30:])  # EOS and padding stay.
  changed = (noised[:, :30] != inputs[:, :30]).mean()
  assert 0.2 < changed < 0.3, changed
  assert noised.min() >= 0 and noised[:, :30].min() >= distillation.FIRST_PIECE
  np.testing.assert_array_equal(noised, distillation.noised_inputs(inputs, 0.25, 8000, 1, 7))
  assert (noised != distillation.noised_inputs(inputs, 0.25, 8000, 1, 8)).any()
  np.testing.assert_array_equal(distillation.noised_inputs(inputs, 0.0, 8000, 1, 7), inputs)


def test_on_policy_batch_decodes_with_the_right_model_and_temperature(tiny_pair):
  teacher, draft = tiny_pair
  inputs = _inputs(0)
  reference = {'inputs': inputs, 'targets': np.array([[5, 1], [6, 7]] * (ROWS // 2), np.int32),
               'decoder_inputs': np.array([[0, 5], [0, 6]] * (ROWS // 2), np.int32)}
  rng = jax.random.PRNGKey(9)
  expected_models = {'draft_samples': (draft, DRAFT, 1.0),
                     'target_samples': (teacher, TEACHER, 1.0),
                     'target_greedy': (teacher, TEACHER, 0.0)}
  batches = {}
  for source, (params, config, temperature) in expected_models.items():
    batch = batches[source] = _on_policy_batch(reference, source, rng, tiny_pair)
    output = baseline.generate({'params': params}, inputs, rng, config=config,
                               max_decode_length=MAX_DECODE_LENGTH,
                               sampling=SamplingConfig(temperature=temperature))
    lengths = np.asarray(output.lengths)
    width = batch['targets'].shape[1]
    assert width == training.length_bucket(lengths.max())
    np.testing.assert_array_equal(batch['targets'], np.asarray(output.tokens)[:, :width])
    np.testing.assert_array_equal(batch['mask'], np.arange(width)[None] < lengths[:, None])
    np.testing.assert_array_equal(batch['decoder_inputs'][:, 1:], batch['targets'][:, :-1])
    assert not batch['decoder_inputs'][:, 0].any()
    np.testing.assert_array_equal(batch['inputs'], inputs)
  # Independent of generate: greedy targets are the teacher's teacher-forced argmax.
  greedy = batches['target_greedy']
  logits = jax.jit(T5(TEACHER).apply)({'params': teacher}, inputs, greedy['decoder_inputs'])
  np.testing.assert_array_equal(np.where(greedy['mask'], np.argmax(logits, -1), 0),
                                greedy['targets'])
  # The sources really differ (different models, or sampled against greedy).
  assert not np.array_equal(batches['draft_samples']['targets'],
                            batches['target_samples']['targets'])
  assert not np.array_equal(batches['target_samples']['targets'], greedy['targets'])
  kept = _on_policy_batch(reference, 'references', rng, tiny_pair)
  np.testing.assert_array_equal(kept['targets'], reference['targets'])
  np.testing.assert_array_equal(kept['mask'], reference['targets'] > 0)


def test_greedy_targets_are_each_inputs_own_greedy_decode(tiny_pair):
  teacher, _ = tiny_pair
  rng = np.random.RandomState(5)
  input_ids = [rng.randint(3, 64, size=n).tolist() + [EOS_ID] for n in (3, 20, 7, 1, 11)]
  targets = distillation.greedy_targets({'params': teacher}, TEACHER, input_ids,
                                        MAX_DECODE_LENGTH, batch_size=ROWS)
  # Independent of the ordering and row padding: one row at a time, in input order.
  for ids, target in zip(input_ids, targets):
    row = np.zeros((1, 32), np.int32)
    row[0, :len(ids)] = ids
    output = baseline.generate({'params': teacher}, row, config=TEACHER,
                               max_decode_length=MAX_DECODE_LENGTH,
                               sampling=SamplingConfig(temperature=0.0))
    assert target == output.tokens[0, :int(output.lengths[0])].tolist()


def test_on_policy_tvd_training_raises_the_measured_alpha(tiny_pair):
  teacher, draft = tiny_pair
  sampling = SamplingConfig(temperature=1.0)
  samples = benchmark.sample_target_outputs(
      {'params': teacher}, TEACHER, np.concatenate([_inputs(100), _inputs(101)]),
      MAX_DECODE_LENGTH, sampling, jax.random.PRNGKey(5), 10**6, batch_size=ROWS)

  def alpha(params):
    return benchmark.measured_alpha(samples, {'params': teacher}, TEACHER, T5Drafter(DRAFT),
                                    {'params': params}, sampling, batch_size=ROWS).alpha

  optimizer = training.make_optimizer(
      training.OptimizerConfig(name='adamw', learning_rate=1e-2, warmup_steps=1), 30)
  params, opt_state = draft, optimizer.init(draft)
  before = alpha(params)
  divergence = distillation.DivergenceConfig(name='tvd')
  for step in range(30):
    # On-policy: the draft's own samples, from the current params.
    batch = _on_policy_batch({'inputs': _inputs(step)}, 'draft_samples',
                             distillation.step_key(0, step), tiny_pair, draft=params)
    params, opt_state, _ = distillation.distill_step(
        params, opt_state, batch, teacher, config=DRAFT, teacher_config=TEACHER,
        optimizer=optimizer, divergence=divergence)
  after = alpha(params)
  assert after > before + 0.05, (before, after)


# ---------------------------------------------------------------------------
# scripts/train.py with a teacher.


@pytest.fixture(autouse=True)
def _unlocked_gin():
  """Parsing locks gin's config; unlock it again so later tests can register."""
  yield
  gin.clear_config()


def _train_config(tmp_path, run, extra=''):
  return f"""
include 'gin/models/tiny_pair.gin'
include 'gin/train_defaults.gin'
MODEL = @tiny_draft/jaxspec.T5Config()
train.corpus = 'ende'
train.input_length = 16
train.target_length = 16
train.batch_size = 8
train.checkpoint_dir = '{tmp_path / run}'
train.checkpoint_every = 2
train.eval_every = 2
train.eval_examples = 8
train.alpha_tokens = 30
train.max_train_examples = 64
train.log_every = 1000
train.teacher_model = @tiny_target/jaxspec.T5Config()
train.teacher_checkpoint = '{tmp_path / 'teacher'}'
""" + extra


ON_POLICY = """
train.divergence = @jaxspec.DivergenceConfig()
jaxspec.DivergenceConfig.name = 'jsd'
train.data_mix = @jaxspec.DataMixConfig()
jaxspec.DataMixConfig:
  draft_samples = 0.4
  target_samples = 0.2
  target_greedy = 0.2
  references = 0.2
"""


def _run(tmp_path, text, bindings=()):
  gin.clear_config()
  path = tmp_path / 'config.gin'
  path.write_text(text)
  gin_flags.parse([f'--gin_file={path}'] + [f'--gin.{b}' for b in bindings])
  return train_script.train()


@pytest.fixture
def teacher_checkpoint(tmp_path):
  gin.clear_config()
  gin_flags.parse(['--gin_file=gin/models/tiny_pair.gin'])
  with gin.config_scope('tiny_target'):
    config = gin.get_configurable('jaxspec.T5Config')()
  save_t5x_checkpoint(tmp_path / 'teacher', init_params(config, jax.random.PRNGKey(3)), 1)
  return tmp_path


def test_on_policy_run_resumes_to_the_same_parameters(teacher_checkpoint):
  tmp_path = teacher_checkpoint
  # The draft's own samples are the source that depends on the params being resumed.
  mix = ON_POLICY.replace('target_samples = 0.2', 'target_samples = 0.0').replace(
      'target_greedy = 0.2', 'target_greedy = 0.0')
  config = lambda run: _train_config(tmp_path, run, mix + 'train.alpha_tokens = 0\n')
  _run(tmp_path, config('straight'), ['train.num_steps=4'])
  _run(tmp_path, config('interrupted'), ['train.num_steps=2'])
  _run(tmp_path, config('interrupted'), ['train.num_steps=4'])
  expected = load_t5x_checkpoint(str(tmp_path / 'straight' / 'checkpoint_4'))
  actual = load_t5x_checkpoint(str(tmp_path / 'interrupted' / 'checkpoint_4'))
  jax.tree_util.tree_map(np.testing.assert_array_equal, actual, expected)
  # Steps 0..3 draw both sources (seed 0), so both kinds of batch were replayed.
  data_mix = gin.query_parameter('train.data_mix').scoped_configurable_fn()
  assert {distillation.batch_source(data_mix, 0, step) for step in range(4)} == {
      'draft_samples', 'references'}


def test_sequence_kd_on_cached_teacher_outputs_logs_validation_alpha(teacher_checkpoint,
                                                                      capsys):
  tmp_path = teacher_checkpoint
  extra = f"""
train.sequence_kd = True
train.sequence_kd_cache_dir = '{tmp_path / 'cache'}'
"""
  _run(tmp_path, _train_config(tmp_path, 'first', extra), ['train.num_steps=2'])
  (cache_file,) = (tmp_path / 'cache').iterdir()
  with np.load(cache_file) as cached:
    targets = np.split(cached['tokens'], cached['ends'][:-1])
  assert len(targets) == 64
  # The teacher's greedy decodes of the first training inputs, in file order.
  teacher = gin.query_parameter('train.teacher_model').scoped_configurable_fn()
  teacher_params = {'params': load_t5x_checkpoint(str(tmp_path / 'teacher'))}
  vocab = corpora.Vocabulary()
  inputs = np.zeros((8, 16), np.int32)
  for row, example in enumerate(corpora.load_split('ende', 'train')[:8]):
    ids = corpora.encode_example(example, 'ende', vocab, 16, 16)[0]
    inputs[row, :len(ids)] = ids
  output = baseline.generate(teacher_params, inputs, config=teacher, max_decode_length=16,
                             sampling=SamplingConfig(temperature=0.0))
  for row in range(8):
    np.testing.assert_array_equal(targets[row],
                                  output.tokens[row, :int(output.lengths[row])])
  log = [json.loads(line) for line in (tmp_path / 'first' / 'train_log.jsonl').open()]
  assert [record['step'] for record in log] == [0, 2]
  for record in log:
    assert 0.0 <= record['validation_alpha_t0'] <= 1.0
    assert 0.0 < record['validation_alpha_t1'] <= 1.0
  assert log[1]['validation_alpha_t1'] != log[0]['validation_alpha_t1']  # It trained.
  capsys.readouterr()
  _run(tmp_path, _train_config(tmp_path, 'second', extra + 'train.alpha_tokens = 0\n'),
       ['train.num_steps=1'])
  assert 'teacher greedy targets read from' in capsys.readouterr().out
  assert len(list((tmp_path / 'cache').iterdir())) == 1


def test_distillation_without_a_teacher_is_refused(teacher_checkpoint):
  tmp_path = teacher_checkpoint
  text = _train_config(tmp_path, 'run', ON_POLICY).replace('train.teacher_checkpoint', '# ')
  with pytest.raises(ValueError, match='train.divergence needs a teacher'):
    _run(tmp_path, text, ['train.num_steps=1'])
  text = _train_config(tmp_path, 'run', ON_POLICY).replace('train.divergence', '# ')
  with pytest.raises(ValueError, match='set train.divergence too'):
    _run(tmp_path, text.replace("jaxspec.DivergenceConfig.name = 'jsd'", ''),
         ['train.num_steps=1'])

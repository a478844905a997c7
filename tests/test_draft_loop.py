"""The draft loop forms (jaxspec/decoding/drafters/loops.py): a proposal's draft steps
in a while loop that exits once every row has stopped, or in a loop of gamma steps whose
trip count XLA sees. They must decode alike, bit for bit:

- run_draft_steps itself: the early exit stops where its condition turns false, the
  static form runs every step and a step that starts with no row drafting is told so
  (live False), 'auto' resolves by the platform the program is lowered for.
- Every drafter that loops (T5, encoder-sharing, int8, staged with a T5 proposer and
  nested), greedy and sampled, token, coupled and block verification, adaptive gamma,
  shorter verify steps and sampled token trees:
  speculative_generate gives the same tokens, log-probabilities, statistics, trace and
  drafter statistics with draft_loop 'early_exit' and 'static', and at temperature 0
  (and coupled) the baseline's tokens. The setup makes proposals end early (an EOS-heavy
  target and drafts), and the cases check that some iteration ended every row's
  proposal before gamma (staged: filled gamma in fewer than gamma - 1 rounds), where
  the two forms differ in the steps they run.
- SpeculativeConfig checks the setting, and leaves it out of its description at 'auto'
  (output directories and calibrations keep their fingerprints).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_accelerator_path import _params  # random params in the kernels' layout
from jaxspec import inference
from jaxspec.config import get_config
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import (FeatureDrafter, Int8Drafter, SharedEncoderDrafter,
                                       StagedDrafter, T5Drafter)
from jaxspec.decoding.drafters import loops
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import feature_draft, shared_encoder_draft
from jaxspec.sampling import SamplingConfig

ONE_LAYER = {'num_encoder_layers': 1, 'num_decoder_layers': 1}
TARGET = get_config('test_tiny_1_1', **ONE_LAYER)
DRAFT = get_config('test_tiny_1_1', num_heads=2, **ONE_LAYER)  # another, narrower T5
MAX_LEN = 12
GAMMA = 4
GREEDY = SamplingConfig()
# Sampled at a temperature that keeps the EOS-heavy drafts ending proposals early.
T1 = SamplingConfig(temperature=0.5)


# ----------------------------------------------------------------------------------
# run_draft_steps.


def _count_steps(form, stops_after, first=1, stop=5):
  """Runs a toy loop: step i adds 1 to `steps` (live or not) and to `kept` only where
  live; the rows stop after `stops_after` steps. -> (steps, kept, last index seen)."""
  def running(carry):
    return carry[0] < stops_after

  def step(i, carry, live):
    steps, kept_steps, _ = carry
    return steps + 1, kept_steps + loops.kept(live, 1), i

  return jax.jit(lambda: loops.run_draft_steps(
      form, first, stop, running, step, (jnp.int32(0), jnp.int32(0), jnp.int32(-1))))()


@pytest.mark.parametrize('stops_after, expected_early', [(2, 2), (10, 4), (0, 0)])
def test_the_early_exit_stops_and_the_static_loop_runs_every_step(stops_after,
                                                                  expected_early):
  steps, kept_steps, last = _count_steps(loops.EARLY_EXIT, stops_after)
  assert (int(steps), int(kept_steps)) == (expected_early, expected_early)
  assert int(last) == (expected_early if expected_early else -1)  # i runs 1..stop-1
  steps, kept_steps, last = _count_steps(loops.STATIC, stops_after)
  assert int(steps) == 4 and int(last) == 4
  assert int(kept_steps) == expected_early  # the steps after the stop are not live
  # 'auto' on the CPU is the early exit.
  assert [int(x) for x in _count_steps(loops.AUTO, stops_after)[:2]] == [expected_early] * 2


def test_auto_is_the_early_exit_on_cpu_and_static_elsewhere():
  assert loops.draft_loop_for('cpu') == loops.EARLY_EXIT
  for platform in ('gpu', 'cuda', 'rocm', 'tpu'):
    assert loops.draft_loop_for(platform) == loops.STATIC
  assert loops.draft_loop_for('cpu', loops.STATIC) == loops.STATIC
  assert loops.draft_loop_for('tpu', loops.EARLY_EXIT) == loops.EARLY_EXIT
  with pytest.raises(ValueError, match='draft_loop'):
    loops.draft_loop_for('cpu', 'fast')


def _exported_toy_loop(form, platform):
  """The toy loop's StableHLO, exported for `platform` from here."""
  def program(x):
    return loops.run_draft_steps(form, 1, 5, lambda c: c < 3.0,
                                 lambda i, c, live: c + loops.kept(live, 1.0, 0.0), x)
  return jax.export.export(jax.jit(program), platforms=(platform,))(
      jax.ShapeDtypeStruct((), jnp.float32)).mlir_module()


def _body_text(module):
  return module[module.index('stablehlo.while'):]


def test_auto_keeps_the_form_of_the_platform_it_is_lowered_for():
  for platform in ('cpu', 'tpu', 'cuda'):
    auto = _exported_toy_loop(loops.AUTO, platform)
    assert auto.count('stablehlo.while') == 1  # one form kept, the other dropped
    # The static body discards the steps after the stop (a select); the early exit
    # never runs them.
    assert ('stablehlo.select' in _body_text(auto)) is (platform != 'cpu'), platform
  assert 'stablehlo.select' not in _body_text(_exported_toy_loop(loops.EARLY_EXIT, 'tpu'))
  assert 'stablehlo.select' in _body_text(_exported_toy_loop(loops.STATIC, 'cpu'))


# ----------------------------------------------------------------------------------
# Decodes: both forms alike, bit for bit.


@functools.cache
def _target():
  return _params(TARGET, 3, eos_scale=3.0)  # rows end at different lengths


@functools.cache
def _draft():
  return _params(DRAFT, 4, eos_scale=5.0)  # drafts that end at EOS inside a proposal


@functools.cache
def _encoder_tokens():
  return np.random.default_rng(5).integers(2, TARGET.vocab_size, (5, 7)).astype(np.int32)


@functools.cache
def _shared_encoder_params():
  return shared_encoder_draft.from_target_decoder(jax.device_get(_target()))


def _drafter(name):
  """(drafter, params) by name."""
  int8 = Int8Drafter(TARGET)
  if name == 't5':
    return T5Drafter(DRAFT), _draft()
  if name == 'shared_encoder':
    return SharedEncoderDrafter(TARGET, TARGET.emb_dim), _shared_encoder_params()
  if name == 'int8':
    return int8, int8.draft_params(_target())
  if name == 'feature':  # a feature-level head (random weights) over the target
    head = FeatureDrafter(TARGET)
    head_params = feature_draft.init_params(head.head_config, jax.random.PRNGKey(6))
    return head, FeatureDrafter.make_params(head_params, jax.device_get(_target()))
  if name == 'staged':  # the int8 draft speculated with a small T5, itself staged
    inner = StagedDrafter(int8, T5Drafter(DRAFT), lookahead=1)
    return (StagedDrafter(int8, inner, lookahead=2),
            {'drafter': int8.draft_params(_target()),
             'proposer': {'drafter': int8.draft_params(_target()), 'proposer': _draft()}})
  raise ValueError(name)


# name: (drafter, sampling, SpeculativeConfig settings). Drafters without a loop (n-gram,
# prompt lookup) and greedy token trees (a scan of gamma - 1 steps) run alike by
# construction: they never read the setting.
CASES = {
    't5_greedy': ('t5', GREEDY, {}),
    't5_sampled': ('t5', T1, {}),
    't5_coupled': ('t5', T1, {'verification': 'coupled'}),
    't5_block_adaptive_short_verify': ('t5', T1, {
        'verification': 'block', 'draft_confidence_threshold': 0.3, 'verify_lengths': (2,)}),
    't5_tree_sampled': ('t5', T1, {'num_drafts': 2}),
    'shared_encoder_sampled': ('shared_encoder', T1, {}),
    'int8_coupled_greedy': ('int8', GREEDY, {'verification': 'coupled'}),
    'staged_greedy': ('staged', GREEDY, {}),
    'staged_sampled': ('staged', T1, {}),
    'feature_adaptive_sampled': ('feature', T1, {'draft_confidence_threshold': 0.3}),
}


@functools.cache
def _run(case, form):
  name, sampling, settings = CASES[case]
  drafter, params = _drafter(name)
  return speculative_generate(
      _target(), params, _encoder_tokens(), jax.random.PRNGKey(9), target_config=TARGET,
      drafter=drafter, spec=SpeculativeConfig(gamma=GAMMA, draft_loop=form, **settings),
      max_decode_length=MAX_LEN, sampling=sampling, record_trace=True)


@functools.cache
def _baseline(sampling):
  return generate(_target(), _encoder_tokens(), jax.random.PRNGKey(9), config=TARGET,
                  max_decode_length=MAX_LEN, sampling=sampling)


def _every_proposal_ended_early_somewhere(result):
  """Some iteration where every decoding row proposed fewer than gamma drafts: there
  the static loop ran steps the early exit did not."""
  trace = result.trace
  decoding = np.asarray(trace.committed) > 0  # [b, L] the row took part
  drafted = np.where(decoding, np.asarray(trace.num_drafts), 0)
  iterations = np.any(decoding, axis=0)
  return bool(np.any(iterations & (np.max(drafted, axis=0) < GAMMA)))


def _rounds_ended_early_somewhere(result):
  """A staged proposal that filled gamma drafts in fewer than gamma - 1 rounds: the
  static loop ran rounds the early exit did not."""
  proposals = int(result.stats.target_calls)
  return int(result.drafter_stats.rounds) < (GAMMA - 1) * proposals


@pytest.mark.parametrize('case', list(CASES))
def test_both_draft_loops_decode_alike(case):
  early, static = _run(case, loops.EARLY_EXIT), _run(case, loops.STATIC)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(early),
                         jax.device_get(static))
  name, sampling, settings = CASES[case]
  # The T5 cases exercise the draft steps int8 and encoder-sharing drafts share.
  if name == 't5' and settings.get('num_drafts', 1) == 1:
    assert _every_proposal_ended_early_somewhere(early), 'no proposal ended early'
  if name == 'staged':
    assert _rounds_ended_early_somewhere(early), 'no proposal took fewer rounds'
  if sampling.is_greedy or settings.get('verification') == 'coupled':
    np.testing.assert_array_equal(early.output.tokens, _baseline(sampling).tokens)
  lengths = np.asarray(early.output.lengths)
  assert len(set(lengths.tolist())) > 1  # rows end apart


def test_auto_decodes_as_the_early_exit_on_cpu():
  early = _run('t5_sampled', loops.EARLY_EXIT)
  auto = _run('t5_sampled', loops.AUTO)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(early),
                         jax.device_get(auto))


def test_the_setting_is_checked_and_described_only_off_its_default():
  with pytest.raises(ValueError, match='draft_loop'):
    SpeculativeConfig(draft_loop='unrolled')
  assert 'draft_loop' not in inference.describe(SpeculativeConfig(gamma=3))
  assert inference.describe(SpeculativeConfig(gamma=3, draft_loop='static'))[
      'draft_loop'] == 'static'

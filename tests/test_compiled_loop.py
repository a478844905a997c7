"""The compiled speculative program as an accelerator runs it, checked on the CPU.

XLA:GPU runs a while loop whose trip count it cannot see by copying the loop condition
to the host and waiting for the stream at every iteration; one with a known trip count
is enqueued whole. So on accelerators (SpeculativeConfig.draft_loop 'static', what
'auto' lowers to off the CPU):

- the outer speculative while loop is the only loop without a known trip count in the
  optimized program: every loop inside an iteration (the draft steps, a staged drafter's
  rounds and its proposer's steps) carries XLA's known_trip_count, and with the early
  exit the same check finds the data-dependent draft loop (the check has power);
- nothing inside an iteration moves through the host (no infeed, outfeed, send, recv or
  host callback), whatever the drafter and verification;
- the speculative loop of every drafter that runs on accelerators (T5, encoder-sharing,
  int8, n-gram, prompt lookup, staged) and every verification mode (token greedy and
  sampled, block with adaptive gamma and shorter verify steps, coupled, token trees), and
  the baseline's loop, lower for TPU and CUDA from here (jax.export, the CPU kernels
  off: T5Config.cpu_matmul 'xla'): an operation a TPU or GPU cannot lower fails here,
  not on the first accelerator job. Lowering only; nothing is compiled for them.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from test_accelerator_path import (ONE_LAYER, _encoder_tokens, _params, computations,
                                   host_transfers, reachable)
from jaxspec.config import EOS_ID, get_config
from jaxspec.decoding import baseline, speculative
from jaxspec.decoding.drafters import (BigramDrafter, FeatureDrafter, Int8Drafter,
                                       PromptLookupDrafter,
                                       SharedEncoderDrafter, StagedDrafter, T5Drafter)
from jaxspec.decoding.speculative import SpeculativeConfig
from jaxspec.model import feature_draft, shared_encoder_draft
from jaxspec.sampling import SamplingConfig

TARGET = get_config('test_tiny_1_1', cpu_matmul='xla', **ONE_LAYER)
DRAFT = get_config('test_tiny_1_0', cpu_matmul='xla', **ONE_LAYER)
GAMMA = 3
MAX_LEN = 16
GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)
PLATFORMS = ('tpu', 'cuda')


@functools.cache
def _target():
  return _params(TARGET, 0)


def _drafter(name):
  """(drafter, params) of each kind that runs on accelerators."""
  int8 = Int8Drafter(TARGET)
  if name == 't5':
    return T5Drafter(DRAFT), _params(DRAFT, 1)
  if name == 'shared_encoder':
    return (SharedEncoderDrafter(TARGET, TARGET.emb_dim),
            shared_encoder_draft.from_target_decoder(jax.device_get(_target())))
  if name == 'int8':
    return int8, int8.draft_params(_target())
  if name == 'bigram':
    return BigramDrafter(TARGET.vocab_size), jnp.zeros((TARGET.vocab_size,) * 2)
  if name == 'prompt_lookup':
    return PromptLookupDrafter(TARGET.vocab_size), ()
  if name == 'feature':  # a feature-level head of one layer over the target
    head = FeatureDrafter(TARGET)
    head_params = feature_draft.init_params(head.head_config, jax.random.PRNGKey(2))
    return head, FeatureDrafter.make_params(head_params, jax.device_get(_target()))
  if name == 'staged':  # the int8 draft speculated with a small T5
    return (StagedDrafter(int8, T5Drafter(DRAFT), lookahead=1),
            {'drafter': int8.draft_params(_target()), 'proposer': _params(DRAFT, 1)})
  raise ValueError(name)


def _speculative_program(drafter_name, sampling, batch=2, **settings):
  """(the jitted speculative loop with its statics bound, its arguments)."""
  drafter, params = _drafter(drafter_name)
  program = jax.jit(functools.partial(
      speculative._speculative_generate,  # pylint: disable=protected-access
      target_config=TARGET, drafter=drafter,
      spec=SpeculativeConfig(gamma=GAMMA, **settings), max_decode_length=MAX_LEN,
      sampling=sampling, eos_id=EOS_ID))
  return program, (_target(), params, jnp.asarray(_encoder_tokens(batch)),
                   jax.random.PRNGKey(0))


# ----------------------------------------------------------------------------------
# The optimized program's loops.


_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def while_loops(hlo_text: str) -> dict[str, list[tuple[str, int | None]]]:
  """{computation: [(its while instruction's body name, XLA's known trip count or None)]}
  of an optimized HLO module's text."""
  _, found = computations(hlo_text)
  loops = {}
  for name, lines in found.items():
    for line in lines:
      if re.search(r' while\(', line):
        trip_count = _KNOWN_TRIP_COUNT.search(line)
        body = re.search(r'body=%?([\w.\-]+)', line).group(1)
        loops.setdefault(name, []).append(
            (body, int(trip_count.group(1)) if trip_count else None))
  return loops


def _runs_products(found, computation) -> bool:
  """Whether a computation runs a matrix product (a decode step), in itself or in what
  it calls; XLA's own loops (a scatter expanded into dynamic-update-slices on the CPU)
  do not."""
  return any(re.search(r' (dot|convolution)\(', line)
             for name in reachable(found, computation) for line in found[name])


def loop_structure(hlo_text: str) -> dict:
  """The outer speculative loop and what runs inside one of its iterations:
  {'outer_loops': [known trip count or None of each of the entry's whiles],
  'inner_trip_counts': [the same of every while an iteration runs],
  'inner_decode_loops': [the same of those that run decode steps (matrix products)],
  'host_transfers': [instructions of an iteration that involve the host]}."""
  entry, found = computations(hlo_text)
  loops = while_loops(hlo_text)
  outer = loops.get(entry, [])
  inner, decode_loops, transfers = [], [], []
  for body, _ in outer:
    inside = reachable(found, body)
    for name in inside:
      for inner_body, count in loops.get(name, []):
        inner.append(count)
        if _runs_products(found, inner_body):
          decode_loops.append(count)
    transfers += host_transfers('\n'.join(line for name in inside for line in found[name]))
  return {'outer_loops': [count for _, count in outer], 'inner_trip_counts': inner,
          'inner_decode_loops': decode_loops, 'host_transfers': transfers}


@functools.cache
def _compiled_structure(drafter_name, sampling, **settings):
  program, args = _speculative_program(drafter_name, sampling, **settings)
  return loop_structure(program.lower(*args).compile().as_text())


# (drafter, sampling, settings) -> the known trip counts of the loops of decode steps an
# iteration runs with the static draft loop: gamma - 1 draft steps, gamma - 1 staged
# rounds (each with a proposal of `lookahead` tokens: lookahead - 1 steps, no loop at
# lookahead 1). Other loops an iteration runs are XLA's own (on the CPU a scatter becomes
# a loop of dynamic-update-slices), with known trip counts too.
STATIC_CASES = {
    't5_greedy': (('t5', GREEDY, ()), [GAMMA - 1]),
    't5_block_adaptive_short_verify': (
        ('t5', T1, (('verification', 'block'), ('draft_confidence_threshold', 0.3),
                    ('verify_lengths', (2,)))), [GAMMA - 1]),
    'staged_sampled': (('staged', T1, ()), [GAMMA - 1]),
    'feature_coupled': (('feature', T1, (('verification', 'coupled'),)), [GAMMA - 1]),
}


@pytest.mark.parametrize('case', list(STATIC_CASES))
def test_the_outer_loop_is_the_only_data_dependent_loop(case):
  (name, sampling, settings), expected = STATIC_CASES[case]
  structure = _compiled_structure(name, sampling, draft_loop='static', **dict(settings))
  assert structure['outer_loops'] == [None]  # one speculative loop, data-dependent
  assert None not in structure['inner_trip_counts']
  assert sorted(structure['inner_decode_loops']) == sorted(expected)
  assert structure['host_transfers'] == []


def test_the_early_exit_is_a_data_dependent_loop_inside_an_iteration():
  structure = _compiled_structure('t5', GREEDY, draft_loop='early_exit')
  assert structure['outer_loops'] == [None]
  # The draft steps: a loop that exits once every row has stopped.
  assert structure['inner_decode_loops'] == [None]
  assert structure['host_transfers'] == []


def test_auto_compiles_the_early_exit_on_the_cpu():
  assert (_compiled_structure('t5', GREEDY) ==
          _compiled_structure('t5', GREEDY, draft_loop='early_exit'))


def test_the_loop_check_sees_a_host_callback_in_an_iteration():
  def body(x):
    jax.debug.callback(lambda v: None, x)
    return x + 1
  text = jax.jit(lambda x: jax.lax.while_loop(lambda v: v < 3, body, x)).lower(
      jnp.int32(0)).compile().as_text()
  structure = loop_structure(text)
  assert structure['outer_loops'] == [None] and structure['host_transfers']


# ----------------------------------------------------------------------------------
# Lowered for TPU and CUDA from the CPU.


# drafter -> the (sampling, settings) it is lowered with; the T5 drafter takes every
# verification mode, the others the modes whose proposal routes they override.
EXPORT_CASES = {
    't5': [(GREEDY, {}), (T1, {}), (T1, {'verification': 'block',
                                          'draft_confidence_threshold': 0.3,
                                          'verify_lengths': (2,)}),
           (T1, {'verification': 'coupled'}), (GREEDY, {'num_drafts': 2}),
           (T1, {'num_drafts': 2})],
    'shared_encoder': [(T1, {'verification': 'coupled'})],
    'int8': [(GREEDY, {'verification': 'coupled'}), (T1, {})],
    'bigram': [(T1, {})],
    'prompt_lookup': [(GREEDY, {'draft_confidence_threshold': 0.5})],
    'staged': [(T1, {})],
    'feature': [(GREEDY, {}), (T1, {'verification': 'coupled'}), (GREEDY, {'num_drafts': 2})],
}


def _export(program, args):
  exported = jax.export.export(program, platforms=PLATFORMS)(*args)
  assert exported.platforms == PLATFORMS
  return exported.mlir_module()


@pytest.mark.parametrize('drafter_name', list(EXPORT_CASES))
def test_the_speculative_loop_lowers_for_tpu_and_cuda(drafter_name):
  for sampling, settings in EXPORT_CASES[drafter_name]:
    module = _export(*_speculative_program(drafter_name, sampling, **settings))
    assert 'custom_call' not in module, (drafter_name, settings)  # plain XLA
    assert 'stablehlo.while' in module


def test_the_baseline_lowers_for_tpu_and_cuda():
  program = jax.jit(functools.partial(
      baseline._generate,  # pylint: disable=protected-access
      config=TARGET, max_decode_length=MAX_LEN, sampling=T1, eos_id=EOS_ID,
      rescale_log_probs=True))
  module = _export(program, (_target(), jnp.asarray(_encoder_tokens(2)),
                             jax.random.PRNGKey(0)))
  assert 'custom_call' not in module


def test_lowering_for_tpu_refuses_what_a_tpu_cannot_run():
  """The check has power: the CPU kernels (cpu_matmul 'kernel', an FFI call registered
  for the CPU alone) do not lower for a TPU."""
  from jaxspec.model.cpu import matmul as cpu_matmul  # pylint: disable=import-outside-toplevel
  if not cpu_matmul.kernel_available():
    pytest.skip('the CPU kernel is not built here')
  config = TARGET.replace(cpu_matmul='kernel')
  drafter = Int8Drafter(config)
  program = jax.jit(functools.partial(
      speculative._speculative_generate,  # pylint: disable=protected-access
      target_config=config, drafter=drafter, spec=SpeculativeConfig(gamma=GAMMA),
      max_decode_length=MAX_LEN, sampling=GREEDY, eos_id=EOS_ID))
  with pytest.raises(Exception, match='(?i)custom call|platform|ffi|lowering'):
    _export(program, (_target(), drafter.draft_params(_target()),
                      jnp.asarray(_encoder_tokens(1)), jax.random.PRNGKey(0)))

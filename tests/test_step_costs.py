"""The step-cost harness (jaxspec/measure/step_costs.py, scripts/step_costs.py) on a tiny target.

No timing is asserted: the tests check what is measured and written, and XLA's cost
analysis against the FLOPs counted by hand from the architecture.
"""

import json
import math

import jax
import pytest

from jaxspec.measure import step_costs
from jaxspec.config import get_config
from jaxspec.model import init_params
from jaxspec.model.cpu import layout as kernel_layout

from jaxspec.launch import step_costs as step_costs_script

SETUP = step_costs.StepCostSetup(source_length=6, cache_position=3, cache_length=12,
                                 steps_per_call=2, repeats=2)


def _matmul_flops(config, k):
  """FLOPs of the decoder's projections and logits for k new positions, by hand."""
  e, joined, f, v = (config.emb_dim, config.num_heads * config.head_dim, config.mlp_dim,
                     config.vocab_size)
  per_layer = 4 * e * joined + 2 * e * joined + 3 * e * f  # self q,k,v,o; cross q,o; MLP
  return 2 * k * (config.num_decoder_layers * per_layer + e * v)


def _tiled_leaves(params):
  return [path for path, _ in jax.tree_util.tree_leaves_with_path(params)
          if kernel_layout.KERNEL_TILES_PARAM in jax.tree_util.keystr(path)]


def test_variants_name_a_layout_and_a_cpu_matmul():
  params = {'params': init_params(get_config('test_tiny_1_1'), jax.random.PRNGKey(0))['params']}
  for name, (layout, cpu_matmul) in step_costs.VARIANTS.items():
    variant_params, config = step_costs.variant(params, get_config('test_tiny_1_1'), name)
    assert config.cpu_matmul == cpu_matmul
    assert kernel_layout.has_transposed_kernels(variant_params) == (
        layout in (kernel_layout.TRANSPOSED, kernel_layout.TILED))
    assert bool(_tiled_leaves(variant_params)) == (layout == kernel_layout.TILED), name
  assert set(step_costs.VARIANTS) == {'t5x', 'transposed', 'kernel', 'tiled'}


def test_tiled_variant_measured_only_where_the_decode_layout_tiles():
  tiles_here = kernel_layout.decode_layout('cpu') == kernel_layout.TILED
  assert step_costs.variants_here() == (
      ('t5x', 'transposed', 'kernel', 'tiled') if tiles_here
      else ('t5x', 'transposed', 'kernel'))
  assert step_costs.decode_variant() == ('tiled' if tiles_here else 'kernel')
  # The decode variant is the layout decoding uses on this CPU.
  layout, cpu_matmul = step_costs.VARIANTS[step_costs.decode_variant()]
  assert (layout, cpu_matmul) == (kernel_layout.decode_layout('cpu'), 'kernel')


def test_measure_step_costs_reports_every_variant_and_position():
  config = get_config('test_tiny_1_1')
  # Position 2 only (the script's test below runs the same steps again, from the cache).
  costs = step_costs.measure_step_costs(config, [2], setup=SETUP)
  assert set(costs.ratio) == set(costs.cost) == set(step_costs.variants_here())
  for variant in costs.ratio:
    assert sorted(costs.ratio[variant]) == [1, 2]  # Position 1 is added.
    assert costs.ratio[variant][1] == 1.0
    assert all(seconds > 0 for seconds in costs.step_seconds[variant].values())
    # XLA's cost analysis of each step against the decoder matmuls counted by hand
    # ('kernel' is analysed with XLA's matmuls: the same arithmetic).
    for k, cost in costs.cost[variant].items():
      # Matmuls dominate; attention, norms and softmax add a little on top.
      assert _matmul_flops(config, k) <= cost['flops'] <= 2 * _matmul_flops(config, k), k
      assert cost['bytes'] > 4 * _matmul_flops(config, 1) / 2  # Every weight is read.


def test_script_writes_json_markdown_and_plot(tmp_path):
  out = tmp_path / 'costs'
  # SETUP's steps: the decode loops test_measure_step_costs compiled are run again.
  step_costs_script.main(['--targets=test_tiny_1_1', '--drafts=test_tiny_1_0',
                          '--positions=1,2', f'--repeats={SETUP.repeats}',
                          f'--steps_per_call={SETUP.steps_per_call}',
                          f'--source_length={SETUP.source_length}',
                          f'--cache_position={SETUP.cache_position}',
                          f'--cache_length={SETUP.cache_length}', '--int8_gamma=2',
                          '--feature_layers=1', f'--out={out}'])
  results = json.loads((out / 'step_costs.json').read_text())
  assert (results['setup']['source_length'], results['setup']['cache_length']) == (6, 12)
  target = results['targets']['test_tiny_1_1']
  assert results['variants'] == list(step_costs.variants_here())
  assert set(target['variants']) == set(step_costs.variants_here())
  for variant in step_costs.variants_here():
    assert set(target['variants'][variant]) == {'1', '2'}
  assert set(results['drafts']['test_tiny_1_0']['proposal_ms']) == set(
      step_costs.variants_here())
  int8 = target['int8_draft']
  # The int8 draft is measured against the target in the CPU's decode layout.
  assert int8['target_variant'] == step_costs.decode_variant()
  # Timings are not asserted (a tiny draft's proposals take microseconds): only that
  # each was measured and reported.
  assert int8['gamma'] == 2 and int8['step_ms'] > 0 and math.isfinite(int8['c'])
  table = (out / 'step_costs.md').read_text()
  assert '| test_tiny_1_1 |' in table and '| test_tiny_1_0 |' in table
  assert f"| test_tiny_1_1 | {int8['target_variant']} | " in table
  assert (f"| 2 | {int8['proposal_ms']:.2f} ms | {int8['c']:.3f} | {int8['verify_ms']:.2f} ms | "
          f"{int8['iteration_ms']:.2f} ms | {int8['interference_ms']:+.2f} ms |") in table
  head = target['feature_head']
  assert (head['layers'], head['gamma'], head['weights']) == (1, 2, 'int8')
  # A slope of two loops, as the int8 draft's proposal: finite, and of any sign on a
  # loaded machine at these sizes.
  assert math.isfinite(head['proposal_ms']) and math.isfinite(head['c'])
  assert (f"| test_tiny_1_1 | 1 | 2 | {head['proposal_ms']:.2f} ms | {head['c']:.3f} | "
          f"{int8['proposal_ms']:.2f} ms | {int8['c']:.3f} |") in table
  assert math.isclose(int8['interference_ms'],
                      int8['iteration_ms'] - int8['proposal_ms'] - int8['verify_ms'])
  assert (out / 'v_of_k.png').read_bytes()[:4] == b'\x89PNG'


def test_int8_draft_cost_rejects_what_it_cannot_measure():
  config = get_config('test_tiny_1_1')
  with pytest.raises(ValueError, match='gamma must be >= 1, got 0'):
    step_costs.measure_int8_draft_cost(config, 0, SETUP)
  with pytest.raises(ValueError, match=r'cache_length 12 must exceed cache_position 3 \+ '
                     r'gamma \+ 1 = 13'):
    step_costs.measure_int8_draft_cost(config, 9, SETUP)
  with pytest.raises(ValueError, match='cache_position must be >= 1'):
    step_costs.measure_int8_draft_cost(
        config, 2, step_costs.StepCostSetup(cache_position=0, cache_length=12))

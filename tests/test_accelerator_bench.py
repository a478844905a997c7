"""jaxspec-accelerator-bench (jaxspec/launch/accelerator_bench.py, jaxspec/measure/accelerator.py)
on the CPU at tiny shapes, so the command that runs on accelerators cannot rot.

No timing is asserted beyond the sign of a time measured whole (a slope of two loops only
for being finite): the tests check what is measured and written, after each part, with
the documented fields and values that hold by construction (V(1) = 1, greedy outputs
identical to the baseline's), and the pure pieces
(bandwidth table, Table 2 arithmetic, budgets, the int8 draft's shapes, a step's bytes)
against independent computations.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import get_config
from jaxspec.decoding.drafters import Int8Drafter
from jaxspec.launch import accelerator_bench
from jaxspec.measure import accelerator, analysis, profile, step_costs
from jaxspec.model.cpu import layout as kernel_layout, matmul as cpu_matmul
from jaxspec.model.quantization import int8_decoder

PARTS = accelerator_bench.PARTS
NAMES = accelerator_bench.PART_NAMES


# ----------------------------------------------------------------------------------
# The pure pieces.


@pytest.mark.parametrize('kind, expected', [
    ('NVIDIA H100 80GB HBM3', 3.35e12), ('NVIDIA H100 PCIe', 2.0e12), ('NVIDIA H200', 4.8e12),
    ('NVIDIA A100-SXM4-80GB', 2.0e12), ('TPU v4', 1.2e12), ('TPU v5 lite', 8.19e11),
    ('TPU v5p', 2.765e12), ('cpu', None), ('Some Future Chip', None)])
def test_peak_bandwidth_by_device_kind(kind, expected):
  assert accelerator.peak_bandwidth(kind) == expected


def test_device_slug_is_a_file_name():
  assert accelerator.device_slug('NVIDIA H100 80GB HBM3') == 'nvidia-h100-80gb-hbm3'
  assert accelerator.device_slug('TPU v5 lite') == 'tpu-v5-lite'
  assert accelerator.bandwidth_fraction(2e9, 1e-3, 4e12) == pytest.approx(0.5)
  assert accelerator.bandwidth_fraction(2e9, 1e-3, None) is None


def test_table2_predictions_follow_the_paper_formulas():
  # With V(k) = 1 the prediction is Theorem 3.8 itself.
  flat = {k: 1.0 for k in (2, 4, 6, 8)}
  rows = accelerator.table2_predictions({'small': 0.02, 'base': None, 'large': 0.1}, flat)
  assert len(rows) == 12 and {r['draft'] for r in rows} == {'small', 'base', 'large'}
  for row in rows:
    if row['draft'] == 'base':
      assert row['predicted_speedup'] is None and row['best_gamma'] is None
      continue
    c = 0.02 if row['draft'] == 'small' else 0.1
    speedups = {g: float(analysis.expected_speedup(row['alpha'], g, c)) for g in (1, 3, 5, 7)}
    assert row['best_gamma'] == max(speedups, key=speedups.get)
    assert row['predicted_speedup'] == pytest.approx(speedups[row['best_gamma']])
    assert row['predicted_at_paper_gamma'] == pytest.approx(speedups.get(row['paper_gamma']))
  # A verify step that costs more than one step lowers the prediction, by the formula.
  costly = accelerator.table2_predictions({'small': 0.02}, {4: 1.5})[0]
  assert costly['best_gamma'] == 3
  expected = analysis.expected_tokens_per_iteration(0.75, 3) / (3 * 0.02 + 1.5)
  assert costly['predicted_speedup'] == pytest.approx(float(expected))
  # Beside them the best chain and the best token tree for these costs
  # (jaxspec.measure.tree_sizing): never past the widest step measured ...
  for row in rows:
    if row['draft'] != 'base':
      chain, tree = row['best_chain'], row['best_tree']
      assert chain['num_drafts'] == 1 and chain['gamma'] <= 7
      assert tree['speedup'] >= chain['speedup'] and tree['positions'] <= 8
  # ... and with V flat to k = 64 (a memory-bound target), a tree of several branches.
  for row in accelerator.table2_predictions({'small': 0.02},
                                            {k: 1.0 for k in (2, 4, 8, 16, 32, 64)}):
    if row['draft'] == 'small':
      assert row['best_tree']['num_drafts'] > 1
      assert row['best_tree']['speedup'] > row['best_chain']['speedup']
  # The paper's rows, transcribed: Table 3's alpha equals Table 2's.
  assert [(r['task'], r['draft'], r['temperature'], r['alpha'], r['paper_speedup'])
          for r in accelerator.PAPER_TABLE2[:3]] == [
              ('EnDe', 'small', 0, 0.75, 3.4), ('EnDe', 'base', 0, 0.8, 2.8),
              ('EnDe', 'large', 0, 0.82, 1.7)]


def test_a_trees_branches_are_drafted_at_the_cost_of_a_batch():
  # Steps of 0.5 ms at batch 1 and 1.2 ms at batch 8 against a 5 ms target step.
  by_branches = accelerator.draft_cost_by_branches({1: 0.5, 8: 1.2}, 5.0)
  assert sorted(by_branches) == list(range(1, 9))
  assert by_branches[1] == pytest.approx(0.1) and by_branches[8] == pytest.approx(0.24)
  assert by_branches[3] == pytest.approx((0.5 + 0.7 * 2 / 7) / 5.0)
  assert accelerator.draft_cost_by_branches({1: 0.5}, 5.0) == pytest.approx(0.1)
  # A draft that costs twice as much per extra row leaves the tree narrower.
  flat = {k: 1.0 for k in (2, 4, 8, 16, 32, 64)}
  cheap = accelerator.table2_predictions({'small': 0.02}, flat)[0]['best_tree']
  costly = accelerator.table2_predictions(
      {'small': 0.02}, flat, branch_c={'small': {m: 0.02 * m for m in range(1, 9)}}
  )[0]['best_tree']
  assert costly['num_drafts'] < cheap['num_drafts'] and costly['speedup'] < cheap['speedup']


def test_budget_splits_what_is_left_among_the_parts_to_come():
  now = [0.0]
  budget = accelerator.Budget(100.0, {'a': 0.5, 'b': 0.0, 'd': 0.25, 'e': 0.25},
                              clock=lambda: now[0])
  assert budget.begin('a', ['b', 'd', 'e']) == pytest.approx(50.0)
  assert budget.allows(49.0) and not budget.allows(51.0)
  now[0] = 20.0  # a used 20 s of its 50: d and e share the 80 left
  assert budget.begin('b', ['d', 'e']) == 0.0
  assert budget.begin('d', ['e']) == pytest.approx(40.0)
  now[0] = 120.0
  assert budget.remaining() < 0 and budget.begin('e', []) == 0.0


@pytest.mark.parametrize('layout', [None, 'fused'])  # this platform's; an accelerator's
def test_int8_draft_shapes_are_those_int8drafter_makes(layout):
  config = get_config('test_tiny_1_1', dtype='bfloat16', param_dtype='bfloat16')
  target = accelerator.random_params(config, layout=layout)
  assert {x.dtype for x in jax.tree_util.tree_leaves(target)} == {jnp.dtype('bfloat16')}
  real = int8_decoder(target, tiled=False)  # Int8Drafter.draft_params off the CPU kernel
  if not cpu_matmul.int8_tiles_apply():
    jax.tree_util.tree_map(np.testing.assert_array_equal, real, Int8Drafter.draft_params(target))
  for made in (accelerator.int8_draft_shapes(target),
               accelerator.random_int8_draft_params(target, seed=1)):
    assert jax.tree_util.tree_structure(made) == jax.tree_util.tree_structure(real)
    for a, b in zip(jax.tree_util.tree_leaves(made), jax.tree_util.tree_leaves(real)):
      assert (a.shape, a.dtype) == (b.shape, b.dtype)


@pytest.mark.parametrize('layout', ['t5x', 'fused'])  # stacked kernels: the same bytes
def test_a_decode_step_reads_the_decoder_weights_and_the_cache(layout):
  config = get_config('test_tiny_1_1')
  params = accelerator.random_params(config, layout=layout)
  setup = step_costs.StepCostSetup(batch_size=2, source_length=5, cache_length=12)
  cache = accelerator.empty_cache(params, config, setup)
  e, h, d, m, v, layers = (config.emb_dim, config.num_heads, config.head_dim, config.mlp_dim,
                           config.vocab_size, config.num_decoder_layers)
  # Self-attention q/k/v/o, cross-attention q/o, the gated MLP, three norms.
  per_layer = 4 * e * h * d + 2 * e * h * d + 3 * e * m + 3 * e
  weights = layers * per_layer + e * v + e + 32 * h  # + logits, final norm, relative biases
  cache_bytes = layers * 2 * 2 * h * d * (12 + 5)  # self and cross keys and values, batch 2
  assert accelerator.decode_step_bytes(params, config, cache) == 4 * (weights + cache_bytes)


def test_flags_are_checked():
  with pytest.raises(SystemExit):
    accelerator_bench._parse_args(['--parts=a,z'])
  with pytest.raises(SystemExit):
    accelerator_bench._parse_args(['--sizes=base,huge'])
  args = accelerator_bench._parse_args(['--parts=e,a', '--positions=9,2,1'])
  assert args.parts == ['a', 'e'] and args.positions == [2, 9] and args.batch_sizes == [1, 8]
  default = accelerator_bench._parse_args([])
  assert default.positions == [2, 4, 6, 8, 9, 16, 32, 64]  # token trees' verify steps
  assert default.variants == ['t5x_layout', 'dot_product_attention']
  assert default.auto_gammas == [1, 2, 3] and default.dtypes == ['bfloat16', 'float32']
  # Part a's cache holds the widest step after its cached positions.
  assert accelerator_bench.Run(default, None, {}, '', '', None).setup(1).cache_length == 84
  tiny = accelerator_bench._parse_args(['--tiny'])
  assert tiny.sizes == ['tiny'] and tiny.batch_sizes == [1] and tiny.positions == [2, 4]
  assert tiny.decode_positions == [4]  # gamma 3 + 1
  assert tiny.auto_gammas == [3]
  chosen = accelerator_bench._parse_args(['--variants=', '--auto_gammas=', '--dtypes=float32'])
  assert chosen.variants == [] and chosen.auto_gammas == [] and chosen.dtypes == ['float32']
  for wrong in ('--variants=fast', '--dtypes=float16', '--auto_gammas=0', '--auto_gammas=x'):
    with pytest.raises(SystemExit):
      accelerator_bench._parse_args([wrong])
  assert tiny.profile_loops == ['early_exit', 'static'] and tiny.profile_variants == 'auto'
  variants = accelerator_bench._parse_args([
      '--profile_variants=cb=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL; '
      'two=--xla_a=1 --xla_b=2', '--profile_loops=static'])
  assert variants.profile_variants == {
      'cb': '--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL', 'two': '--xla_a=1 --xla_b=2'}
  assert variants.profile_loops == ['static']
  assert accelerator_bench._parse_args(['--profile_variants=none']).profile_variants == {}
  for bad in ('--profile_variants=cb', '--profile_variants=cb=xla_a=1',
              '--profile_loops=unrolled'):
    with pytest.raises(SystemExit):
      accelerator_bench._parse_args([bad])
  widths = accelerator_bench._parse_args(['--gamma=2', '--decode_positions=0,gamma,5'])
  assert widths.decode_positions == [0, 3, 5]
  for narrow in ('2', 'four'):  # narrower than gamma + 1; not a width
    with pytest.raises(SystemExit):
      accelerator_bench._parse_args([f'--decode_positions={narrow}'])


def test_a_spent_budget_skips_every_part_and_still_writes(tmp_path):
  record = accelerator_bench.main(['--tiny', '--budget_s=0', f'--output_dir={tmp_path}'])
  assert record['parts_done'] == [] and set(record['parts_skipped']) == set(PARTS)
  written = json.loads((tmp_path / 'cpu-tiny.json').read_text())
  assert written['parts_skipped'] == record['parts_skipped']
  assert (tmp_path / 'cpu-tiny.md').read_text().startswith('# Accelerator bench: cpu')


# ----------------------------------------------------------------------------------
# The whole command, every part, at tiny shapes.


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory):
  """accelerator_bench.main(--tiny) with every write recorded: (record, [(parts done,
  JSON on disk, markdown on disk) after each write], output directory)."""
  out = tmp_path_factory.mktemp('accelerator')
  writes = []
  original = accelerator_bench.Run.write

  def write(self):
    original(self)
    writes.append((list(self.record['parts_done']), json.loads(open(self.json_path).read()),
                   open(self.md_path).read()))

  accelerator_bench.Run.write = write
  try:
    record = accelerator_bench.main(['--tiny', f'--output_dir={out}', '--repeats=2'])
  finally:
    accelerator_bench.Run.write = original
  return record, writes, out


def _positive(value):
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _measured(value):
  """A time taken as the slope of two loops (a proposal, and the c and predicted speedups
  made of it) is only checked for being measured: on a loaded machine the tiny model's
  shorter loop can come out above the longer one (test_loop_overhead says the same)."""
  return isinstance(value, (int, float)) and math.isfinite(value)


def test_every_part_is_written_when_it_ends(tiny_run):
  record, writes, out = tiny_run
  assert record['parts_done'] == list(PARTS)
  headings = {'p': '## p. Where the time goes', 'a': '## a. Step costs', 'b': '## b.',
              'c': '## c. Table 2', 'd': '## d. End', 'e': '## e. Drafters'}
  for index, part in enumerate(PARTS):
    # The first write that reports the part done holds it, on disk, in both files.
    done, on_disk, md = next(w for w in writes if part in w[0])
    assert done == list(PARTS[:index + 1])
    assert NAMES[part] in on_disk['parts'] and on_disk['parts_done'] == done
    assert headings[part] in md
    for later in PARTS[index + 1:]:
      assert headings[later] not in md
  assert json.loads((out / 'cpu-tiny.json').read_text())['parts_done'] == list(PARTS)


def test_the_record_describes_the_run(tiny_run):
  _, writes, _ = tiny_run
  record = writes[-1][1]
  assert record['kind'] == 'accelerator_bench'
  assert record['commit'] is None or len(record['commit']) == 40
  assert record['date'][:4].isdigit()
  device = record['device']
  assert device['platform'] == 'cpu' and device['count'] >= 1 and device['device_kind']
  assert 'memory_bytes' in device and device['peak_bandwidth_bytes_per_s'] is None
  assert record['versions'] == {'jax': jax.__version__,
                                'jaxlib': __import__('jaxlib').__version__}
  assert record['command'].startswith('jaxspec-accelerator-bench --tiny')
  assert record['matmul'].startswith('XLA')  # the accelerator path: XLA on the CPU too
  assert record['provenance']['command'] == record['command']


def test_step_costs(tiny_run):
  record = tiny_run[0]['parts'][NAMES['a']]
  assert record['skipped'] == [] and list(record['targets']['tiny']) == ['batch_1']
  for batch in ('batch_1',):
    entry = record['targets']['tiny'][batch]
    assert sorted(entry['steps']) == [1, 2, 4]
    assert entry['steps'][1]['V'] == 1.0  # by construction
    for k, step in entry['steps'].items():
      assert _positive(step['ms']) and _positive(step['V']), k
      assert step['bandwidth_fraction'] is None  # no peak for a CPU
    assert _positive(entry['step_bytes']) and _positive(entry['int8_draft']['step_bytes'])
    assert entry['int8_draft']['step_bytes'] < entry['step_bytes']  # int8 weights
    assert _measured(entry['int8_draft']['c']) and _positive(entry['small_draft']['c'])
    head = entry['feature_head']  # one layer of the target's width and its LM head
    assert head['layers'] == 1 and _measured(head['proposal_ms']) and _measured(head['c'])
    draft = record['drafts']['small'][batch]
    assert _positive(draft['step_ms']) and _measured(draft['proposal_ms'])
    # The A/B items: each variant's steps beside the run's own, target and draft.
    # The CPU's (tiled where the kernel's AVX-512 build runs); an accelerator's is 'fused'.
    assert record['layout'] == kernel_layout.decode_layout('cpu')
    assert record['layout'] in (kernel_layout.TRANSPOSED, kernel_layout.TILED)
    for variants, fields in ((entry['variants'], ('step', 'verify')),
                             (draft['variants'], ('step',))):
      assert set(variants) == {'t5x_layout', 'dot_product_attention'}
      assert variants['t5x_layout']['layout'] == 't5x'
      assert variants['dot_product_attention']['decode_attention'] == 'dot_product_attention'
      for variant in variants.values():
        for field in fields:
          assert _positive(variant[f'{field}_ms']) and _positive(variant[f'{field}_ratio'])


def test_loop_overhead(tiny_run):
  loop = tiny_run[0]['parts'][NAMES['b']]
  assert loop['iterations'] > 0 and loop['gamma'] == 3 and loop['batch'] == 1
  # Times measured whole are positive; those taken as differences of two (an iteration:
  # the loop less its prologue; a proposal, a verify step: the slope of two loops) only
  # finite, since a loaded machine can put the shorter call above the longer one.
  for field in ('loop_ms', 'prologue_ms'):
    assert _positive(loop[field]), field
  for field in ('iteration_ms', 'proposal_ms', 'verify_ms'):
    assert math.isfinite(loop[field]), field
  assert loop['overhead_ms'] == pytest.approx(
      loop['iteration_ms'] - loop['proposal_ms'] - loop['verify_ms'])


def test_table2_from_the_measured_costs(tiny_run):
  record = tiny_run[0]
  table = record['parts'][NAMES['c']]
  steps = record['parts'][NAMES['a']]['targets']['tiny']['batch_1']['steps']
  assert table['verify_cost'] == {k: s['V'] for k, s in steps.items() if k > 1}
  assert table['branch_c'] == {'small': pytest.approx(table['c']['small'])}  # batch 1 only
  assert len(table['rows']) == 13
  head = table['rows'][-1]  # the feature head, at the alpha measured on the CPU
  assert (head['draft'], head['task'], head['paper_speedup']) == ('feature head', 'EnDe', None)
  assert head['c'] == table['c']['feature head'] and _measured(head['predicted_speedup'])
  assert head['alpha'] == accelerator_bench.FEATURE_ALPHA
  for row in table['rows'][:-1]:
    if row['draft'] == 'small':  # the only draft measured at tiny shapes
      assert _positive(row['c']) and _positive(row['predicted_speedup'])
      assert row['best_gamma'] in (1, 3)
      chain, tree = row['best_chain'], row['best_tree']
      assert chain['num_drafts'] == 1 and tree['speedup'] >= chain['speedup']
      assert tree['positions'] == 1 + tree['num_drafts'] * tree['gamma'] <= 4
    else:
      assert row['c'] is None and row['predicted_speedup'] is None
      assert row['best_chain'] is None and row['best_tree'] is None


def test_end_to_end(tiny_run):
  record = tiny_run[0]['parts'][NAMES['d']]
  # One width by default: gamma + 1 (T5Config.decode_positions), greedy rows identical.
  assert record['skipped'] == [] and record['greedy_identical'] == {'4': True}
  grid = {(r['dtype'], r['decode_positions'], r['batch'], r['temperature'])
          for r in record['rows']}
  assert grid == {(d, 4, b, t) for d in ('bfloat16', 'float32') for b in (1,)
                  for t in (0.0, 1.0)}
  for row in record['rows']:
    baseline, spec = row['baseline'], row['speculative']
    assert _positive(baseline['tokens_per_s']) and _positive(spec['tokens_per_s'])
    assert _positive(spec['speedup']) and 0.0 <= spec['alpha'] <= 1.0
    assert spec['tokens_per_target_call'] >= 1.0
    assert spec['identical_outputs'] is (True if row['temperature'] == 0.0 else None)
    if row['temperature'] == 0.0:  # the same tokens, so as many
      assert spec['tokens'] == baseline['tokens']
    # gamma='auto' in the first dtype, greedy: among 0 and gamma, the baseline's outputs.
    if row['dtype'] == 'bfloat16' and row['temperature'] == 0.0:
      auto = row['auto']
      assert auto['identical_outputs'] is True and _positive(auto['speedup'])
      assert auto['gammas'] == [3] and set(auto['gamma_counts']) <= {0, 3}
      assert sum(auto['gamma_counts'].values()) == 1 + 2 * 8  # the first call, 2 repeats
      assert auto['chose_baseline'] == (set(auto['gamma_counts']) == {0})
      assert set(auto['calibration_speedups']) == {3} and auto['calibration_s'] > 0
    else:
      assert 'auto' not in row
  summary = record['auto']
  assert summary['floor'] == 0.97 and len(summary['rows']) == 1
  assert summary['rows'][0]['batch'] == 1 and summary['rows'][0]['decode_positions'] == 4
  assert summary['never_slower'] == (summary['rows'][0]['speedup'] >= 0.97)


def test_drafters(tiny_run):
  record = tiny_run[0]['parts'][NAMES['e']]
  assert set(record['drafters']) == {'small', 'int8'} and record['skipped'] == []
  assert _positive(record['step_ms']) and _positive(record['verify_cost'])
  for name, entry in record['drafters'].items():
    assert _measured(entry['c']), name
    assert set(entry['runs']) == {0.0, 1.0}
    for temperature, run in entry['runs'].items():
      assert 0.0 <= run['alpha'] <= 1.0 and _positive(run['speedup'])
      assert _measured(run['predicted_speedup'])
      assert run['identical_outputs'] is (True if temperature == 0.0 else None)
  # The int8 copy of the target's own decoder proposes nearly the target's tokens.
  assert record['drafters']['int8']['runs'][0.0]['alpha'] > 0.5


def _check_profile_forms(forms, expected):
  assert sorted(forms) == sorted(expected)
  for form, entry in forms.items():
    assert entry['iterations'] > 0 and entry['tokens'] > 0, form
    for field in ('iteration_ms', 'proposal_ms', 'draft_token_ms', 'loop_ms', 'prologue_ms'):
      assert _positive(entry[field]), (form, field)
    assert entry['draft_token_ms'] == pytest.approx(entry['proposal_ms'] / 3)
    loop, draft = entry['loop'], entry['draft']
    # The CPU has no device streams: the XLA:CPU thunks, no copies to a host, no waits.
    assert _positive(loop['kernels_per_iteration']) and _positive(draft['kernels_per_draft_step'])
    assert loop['d2h_copies_per_iteration'] == loop['host_waits_per_iteration'] == 0
    assert draft['d2h_copies_per_draft_step'] == draft['host_waits_per_draft_step'] == 0
    assert 0.0 <= loop['idle_fraction'] <= 1.0 and loop['busy_ms'] <= loop['span_ms']
    # The draft step's kernels by kind, the longest first, no more kernels than a step has.
    kinds = draft['kernel_kinds']
    assert 0 < len(kinds) <= profile.KERNEL_KINDS
    times = [k['us_per_draft_step'] for k in kinds]
    assert times == sorted(times, reverse=True) and times[-1] > 0
    assert sum(k['kernels_per_draft_step'] for k in kinds) <= draft['kernels_per_draft_step'] + 1e-9


def test_profile(tiny_run):
  record = tiny_run[0]
  part = record['parts'][NAMES['p']]
  assert part['trace_source'] == 'XLA:CPU thunks (host)'
  assert part['draft_loop_auto'] == 'early_exit'  # the CPU's
  assert part['variants'] == {}  # flag variants run on a GPU (or when asked for)
  assert part['skipped'] == [] and part['xla_flags'] == record['xla_flags']
  _check_profile_forms(part['forms'], ['early_exit', 'static'])
  # Both forms run the same draft steps here (random weights: no EOS, no early stop).
  kernels = {f: e['draft']['kernels_per_draft_step'] for f, e in part['forms'].items()}
  assert kernels['static'] == pytest.approx(kernels['early_exit'], rel=0.2)
  assert _positive(part['verify']['kernels_per_verify_step']) and _positive(
      part['verify_step_ms'])
  assert part['verify']['kernel_kinds'][0]['us_per_verify_step'] > 0
  assert 'Kernels of a draft step by kind' in tiny_run[1][-1][2]  # the last markdown


def test_profile_variants_run_in_child_processes(tmp_path):
  """A variant whose flags XLA takes runs part p in a child process under them (here
  one this process already has, so the child loads its programs from the compilation
  cache); one XLA refuses at start-up is recorded as refused."""
  same = '--xla_cpu_parallel_codegen_split_count=1'  # tests/conftest.py sets it
  record = accelerator_bench.main([
      '--tiny', '--parts=p', '--profile_loops=static', '--repeats=2',
      f'--profile_variants=same={same};bogus=--xla_no_such_flag=1',
      f'--output_dir={tmp_path}'])
  variants = record['parts'][NAMES['p']]['variants']
  assert variants['same']['flags'] == same
  assert same in variants['same']['xla_flags']  # the child's own XLA_FLAGS
  _check_profile_forms(variants['same']['forms'], ['static'])
  assert 'xla_no_such_flag' in variants['bogus']['refused']
  assert 'forms' not in variants['bogus']
  written = (tmp_path / 'cpu-tiny.md').read_text()
  assert 'same (`' in written and 'bogus (`--xla_no_such_flag=1`): refused' in written

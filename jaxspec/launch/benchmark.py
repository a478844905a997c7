"""Reproduces the paper's tables on the local pairs, side by side in one run.

  python scripts/benchmark.py                       # every config in DEFAULT_GIN_FILES
  python scripts/benchmark.py --gin_file=configs/benchmark/ende_local.gin \
      --gin.benchmark.walltime_examples=20

For one task, target and set of drafts it measures, in this order:
  alpha      Table 3 and Table 5: alpha (Corollary 3.6) of each drafter over >= alpha_tokens
             target tokens (decoded from the alpha_splits inputs), temperatures 0 and 1,
             per lenience.
  costs      Table 4's inputs: target step time for 1..max_gamma+1 positions, each
             drafter's proposal time for gamma = 1..max_gamma, c (Definition 3.7).
  table2     walltime speedup of speculative decoding over the baseline, batch 1, encode
             included, median of repeated runs, per draft and temperature, at the gamma
             the measured costs predict best; identical outputs counted at temperature 0.
  table4     c, alpha, Theorem 3.8's expected speedup and the measured one.
  sweep      Figure 3: measured speedup for gamma = 1..max_gamma on one pair (PNG).
  batch      tokens/s of baseline and speculative at batch sizes 1, 4, 16 (PNG).
  reference  the baseline against a T5X-style decode loop (cross-attention K/V
             projected at every step) on the same model.
  options    tokens per target call, alpha and walltime of plain (token-wise), block,
             adaptive-gamma and multi-draft verification side by side, same examples
             and keys, batch 1, interleaved with the baseline example by example,
             repeated: speedup over plain speculative decoding and over the baseline.
  beam       beam search against speculative beam search (beam_drafter proposing),
             batch 1, interleaved example by example, repeated: target calls per output
             token, walltime ratio, BLEU/ROUGE of both, identical beams (tokens, and
             tokens and scores). Not in the default sections; configs/benchmark/*_beam.gin
             run it alone.
Writes <output_dir>/results.json, results.md and *.png, and prints the markdown.
"""

from __future__ import annotations

import json
import os
import sys
import time


import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.launch import command, gin_flags
from jaxspec.launch import infer as infer_script
import jaxspec.configurables  # noqa: F401  (registers the dataclasses with gin)
from jaxspec.measure import analysis, benchmark as measure, metrics
from jaxspec import errors, inference, machine
from jaxspec.config import T5Config
from jaxspec.data import corpora
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.beam_search import BeamConfig, generate_beam
from jaxspec.decoding.drafters import (BigramDrafter, Int8Drafter, PromptLookupDrafter,
                                       SharedEncoderDrafterWithTarget, T5Drafter,
                                       UnigramDrafter)
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig, speculative_beam_generate
from jaxspec.sampling import SamplingConfig

DEFAULT_GIN_FILES = ('configs/benchmark/ende54m_local.gin', 'configs/benchmark/ende_local.gin',
                     'configs/benchmark/docsum_local.gin')
SECTIONS = ('alpha', 'costs', 'table2', 'sweep', 'batch', 'reference', 'options', 'beam')
DEFAULT_SECTIONS = SECTIONS[:-1]  # Beam rows on request: they take minutes per task on CPU.
# Drafters without weights, fitted on the task's training split (n-grams) or none.
OTHER_DRAFTERS = {'unigram': UnigramDrafter, 'bigram': BigramDrafter,
                  'prompt lookup': PromptLookupDrafter}


def machine_description() -> dict:
  device = jax.devices()[0]
  return {'device': device.device_kind, 'platform': device.platform, 'cpu': machine.cpu_model(),
          'cpu_count': os.cpu_count(), 'jax': jax.__version__,
          'date': time.strftime('%Y-%m-%d')}


def shared_encoder_label(name: str, drafter) -> str:
  """How the tables name a draft of benchmark.shared_encoder_drafts: 'int8 <name>' for
  an Int8Drafter (the target's decoder in int8), else 'shared encoder <name>' (with
  ' (int8)' for a draft decoded with int8 weights)."""
  if isinstance(drafter, Int8Drafter):
    return f'int8 {name}'
  return f'shared encoder {name}' + (' (int8)' if drafter.weights == 'int8' else '')


class Setup:
  """The task's test inputs (and those alpha is measured on), the target and the
  drafters, loaded once."""

  def __init__(self, task, target_model, target_checkpoint, t5_drafts, draft_checkpoints,
               other_drafters, input_length, max_decode_length, alpha_splits=('test',),
               shared_encoder_drafts=None):
    self.task, self.target_model = task, target_model
    self.max_decode_length = max_decode_length
    vocab = corpora.Vocabulary()

    def split_inputs(split):  # [n, s]
      return inference.pad_rows(
          [corpora.encode_example(e, task, vocab, input_length, max_decode_length)[0]
           for e in corpora.load_split(task, split)], input_length)

    self.inputs = split_inputs('test')
    self.alpha_inputs = np.concatenate([split_inputs(split) for split in alpha_splits])
    self.target_params = inference.load_model_params(target_checkpoint, target_model,
                                                     for_decoding=True)
    vocab_size = target_model.vocab_size
    self.drafters = {f't5 {name}': T5Drafter(config) for name, config in t5_drafts.items()}
    self.drafters.update({name: OTHER_DRAFTERS[name](vocab_size) for name in other_drafters})
    checkpoints = {f't5 {name}': path for name, path in draft_checkpoints.items()}
    self.drafter_params = {
        name: infer_script.drafter_params(drafter, checkpoints.get(name), task, vocab,
                                          max_decode_length)
        for name, drafter in self.drafters.items()}
    # Encoder-sharing drafts run stand-alone here (alpha and proposal times outside
    # speculative decoding), so their params carry the target's for its encoder; an
    # int8 draft is made from the target's params.
    for name, drafter in (shared_encoder_drafts or {}).items():
      label = shared_encoder_label(name, drafter)
      self.drafters[label] = SharedEncoderDrafterWithTarget(drafter, target_model)
      self.drafter_params[label] = {
          'draft': infer_script.drafter_params(drafter, draft_checkpoints.get(name), task,
                                               vocab, max_decode_length,
                                               target_params=self.target_params),
          'target': self.target_params}

  def keys(self, rows, seed=0):
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(seed),
                                                           jnp.asarray(rows))

  def baseline(self, rows, sampling):
    return generate(self.target_params, self.inputs[rows], self.keys(rows),
                    config=self.target_model, max_decode_length=self.max_decode_length,
                    sampling=sampling)

  def beam(self, rows, beam: BeamConfig):
    return generate_beam(self.target_params, self.inputs[rows], config=self.target_model,
                         beam=beam, max_decode_length=self.max_decode_length)

  def speculative_beam(self, rows, beam: BeamConfig, spec: SpeculativeBeamConfig,
                       drafter_name):
    drafter = self.drafters[drafter_name]
    if not isinstance(drafter, T5Drafter):
      raise errors.InvalidSetting(
          f'beam_drafter must name a T5 draft (t5 <name>), got {drafter_name!r}')
    return speculative_beam_generate(
        self.target_params, self.drafter_params[drafter_name], self.inputs[rows],
        target_config=self.target_model, draft_config=drafter.config, beam=beam, spec=spec,
        max_decode_length=self.max_decode_length)

  def speculative(self, rows, sampling, drafter_name, gamma, lenience=1.0, spec=None):
    """spec (a SpeculativeConfig) replaces gamma and lenience when given."""
    return speculative_generate(
        self.target_params, self.drafter_params[drafter_name], self.inputs[rows],
        self.keys(rows), target_config=self.target_model,
        drafter=self.drafters[drafter_name], spec=spec or SpeculativeConfig(gamma, lenience),
        max_decode_length=self.max_decode_length, sampling=sampling)


# ---------------------------------------------------------------------------
# Sections. Each returns JSON-ready rows.


def alpha_section(setup: Setup, temperatures, alpha_tokens, lenience) -> list[dict]:
  rows = []
  for temperature in temperatures:
    sampling = SamplingConfig(temperature=temperature)
    samples = measure.sample_target_outputs(
        setup.target_params, setup.target_model, setup.alpha_inputs, setup.max_decode_length,
        sampling, jax.random.PRNGKey(1), alpha_tokens)
    drafters = {name: (drafter, setup.drafter_params[name])
                for name, drafter in setup.drafters.items()}
    results = measure.measured_alphas(samples, setup.target_params, setup.target_model,
                                      drafters, sampling, lenience)
    for name, result in results.items():
      rows.append({'drafter': name, 'temperature': temperature, 'alpha': result.alpha,
                   'positions': result.positions,
                   'alpha_by_lenience': {str(l): a for l, a in result.alpha_by_lenience.items()}})
  return rows


def costs_section(setup: Setup, max_gamma, repeats) -> dict:
  """Step times in seconds at batch 1 on the first test input."""
  encoder_tokens = setup.inputs[:1]
  cache_length = setup.max_decode_length + max_gamma
  target_step = {k: measure.decode_step_seconds(
      setup.target_params, setup.target_model, encoder_tokens, k, cache_length,
      repeats=repeats) for k in range(1, max_gamma + 2)}
  drafters = {}
  for name, drafter in setup.drafters.items():
    proposal = {g: measure.propose_seconds(
        drafter, setup.drafter_params[name], encoder_tokens, g, cache_length,
        SamplingConfig(temperature=0.0), repeats=repeats) for g in range(1, max_gamma + 1)}
    row = {'proposal_seconds': proposal}
    if isinstance(drafter, T5Drafter):  # Definition 3.7: one draft step over one target step.
      row['step_seconds'] = measure.decode_step_seconds(
          setup.drafter_params[name], drafter.config, encoder_tokens, 1, cache_length,
          repeats=repeats)
      row['c'] = row['step_seconds'] / target_step[1]
    else:
      row['c'] = proposal[1] / target_step[1]
    drafters[name] = row
  return {'target_step_seconds': target_step, 'drafters': drafters}


def predicted_speedup(alpha, gamma, costs, drafter_name) -> float:
  """Expected speedup with the measured costs of a whole iteration.

  E[tokens per iteration] (Eq. 1) times one target step, over one proposal of gamma
  tokens plus one target step of gamma + 1 positions. Theorem 3.8 is the special case
  where the proposal costs gamma c and the verification costs one target step.
  """
  target = costs['target_step_seconds']
  iteration = costs['drafters'][drafter_name]['proposal_seconds'][gamma] + target[gamma + 1]
  return float(analysis.expected_tokens_per_iteration(alpha, gamma) * target[1] / iteration)


def best_gamma(alpha, costs, drafter_name, max_gamma) -> int:
  speedups = [predicted_speedup(alpha, g, costs, drafter_name) for g in range(1, max_gamma + 1)]
  return 1 + int(np.argmax(speedups))


def _generated_tokens(output) -> int:
  return int(np.sum(np.asarray(output.lengths)))


def table2_section(setup: Setup, alphas, costs, temperatures, drafter_names, max_gamma,
                   num_examples, repeats) -> list[dict]:
  rows = []
  for temperature in temperatures:
    sampling = SamplingConfig(temperature=temperature)
    gammas = {name: best_gamma(alphas[(name, temperature)], costs, name, max_gamma)
              for name in drafter_names}
    decoders = {'baseline': lambda i: setup.baseline([i], sampling)}
    for name in drafter_names:
      decoders[name] = (lambda n: lambda i: setup.speculative([i], sampling, n, gammas[n]))(name)
    timed = {}
    totals = measure.time_side_by_side(decoders, num_examples, repeats, timed)
    baseline_tokens = [np.asarray(o.tokens[0]) for o in timed['baseline']]
    for name in drafter_names:
      outputs = timed[name]
      tokens = sum(_generated_tokens(o.output) for o in outputs)
      calls = sum(int(o.stats.row_target_calls[0]) for o in outputs)
      rows.append({
          'task': setup.task, 'drafter': name, 'temperature': temperature,
          'gamma': gammas[name], 'alpha': alphas[(name, temperature)],
          'tokens_per_target_call': tokens / calls,
          'baseline_seconds': float(np.median(totals['baseline'])),
          'speculative_seconds': float(np.median(totals[name])),
          'speedup': float(np.median(totals['baseline']) / np.median(totals[name])),
          'identical_outputs': sum(np.array_equal(np.asarray(o.output.tokens[0]), b)
                                   for o, b in zip(outputs, baseline_tokens)),
          'examples': num_examples, 'repeats': repeats})
  return rows


def table4_rows(table2, costs) -> list[dict]:
  rows = []
  for row in table2:
    drafter = costs['drafters'][row['drafter']]
    target = costs['target_step_seconds']
    rows.append({
        'drafter': row['drafter'], 'temperature': row['temperature'], 'gamma': row['gamma'],
        'alpha': row['alpha'], 'c': drafter['c'],
        'verify_cost': target[row['gamma'] + 1] / target[1],
        'theorem_3_8_speedup': float(analysis.expected_speedup(row['alpha'], row['gamma'],
                                                               drafter['c'])),
        'measured_cost_speedup': predicted_speedup(row['alpha'], row['gamma'], costs,
                                                   row['drafter']),
        'empirical_speedup': row['speedup']})
  return rows


def sweep_section(setup: Setup, alpha, costs, drafter_name, max_gamma, num_examples,
                  repeats) -> dict:
  sampling = SamplingConfig(temperature=0.0)
  decoders = {'baseline': lambda i: setup.baseline([i], sampling)}
  for gamma in range(1, max_gamma + 1):
    decoders[gamma] = (lambda g: lambda i: setup.speculative([i], sampling, drafter_name, g))(gamma)
  totals = measure.time_side_by_side(decoders, num_examples, repeats)
  c = costs['drafters'][drafter_name]['c']
  return {
      'drafter': drafter_name, 'temperature': 0.0, 'alpha': alpha, 'c': c,
      'theorem_3_8_optimal_gamma': analysis.optimal_gamma(alpha, c, max_gamma),
      'measured_cost_optimal_gamma': best_gamma(alpha, costs, drafter_name, max_gamma),
      'rows': [{'gamma': g,
                'measured_speedup': float(np.median(totals['baseline']) / np.median(totals[g])),
                'theorem_3_8_speedup': float(analysis.expected_speedup(alpha, g, c)),
                'measured_cost_speedup': predicted_speedup(alpha, g, costs, drafter_name)}
               for g in range(1, max_gamma + 1)]}


def batch_section(setup: Setup, drafter_name, gamma, batch_sizes, num_examples,
                  repeats) -> list[dict]:
  sampling = SamplingConfig(temperature=0.0)
  rows = []
  for batch_size in batch_sizes:
    batches = [list(range(i, i + batch_size)) for i in range(0, num_examples, batch_size)]
    decoders = {'baseline': lambda i: setup.baseline(batches[i], sampling),
                'speculative': lambda i: setup.speculative(batches[i], sampling, drafter_name,
                                                           gamma)}
    timed = {}
    totals = measure.time_side_by_side(decoders, len(batches), repeats, timed)
    tokens = sum(_generated_tokens(o) for o in timed['baseline'])
    baseline_rate = tokens / np.median(totals['baseline'])
    speculative_rate = tokens / np.median(totals['speculative'])
    rows.append({'batch_size': batch_size, 'drafter': drafter_name, 'gamma': gamma,
                 'baseline_tokens_per_second': float(baseline_rate),
                 'speculative_tokens_per_second': float(speculative_rate),
                 'speedup': float(speculative_rate / baseline_rate),
                 'examples': len(batches) * batch_size})
  return rows


def reference_section(setup: Setup, temperatures, num_examples, repeats) -> list[dict]:
  rows = []
  for temperature in temperatures:
    sampling = SamplingConfig(temperature=temperature)

    def t5x_style(i):
      return measure.t5x_style_generate(
          setup.target_params, setup.inputs[[i]], setup.keys([i]), config=setup.target_model,
          max_decode_length=setup.max_decode_length, sampling=sampling)

    decoders = {'baseline': lambda i: setup.baseline([i], sampling), 't5x_style': t5x_style}
    timed = {}
    totals = measure.time_side_by_side(decoders, num_examples, repeats, timed)
    identical = sum(np.array_equal(np.asarray(reference), np.asarray(ours.tokens))
                    for reference, ours in zip(timed['t5x_style'], timed['baseline']))
    rows.append({'temperature': temperature,
                 't5x_style_seconds': float(np.median(totals['t5x_style'])),
                 'baseline_seconds': float(np.median(totals['baseline'])),
                 'baseline_speedup': float(np.median(totals['t5x_style'])
                                           / np.median(totals['baseline'])),
                 'identical_outputs': identical, 'examples': num_examples})
  return rows


def beam_section(setup: Setup, drafter_name, beam: BeamConfig, spec: SpeculativeBeamConfig,
                 num_examples, repeats) -> dict:
  """Beam search against speculative beam search on the first num_examples test
  examples, batch 1, interleaved example by example and repeated (median totals)."""
  decoders = {'beam': lambda i: setup.beam([i], beam),
              'speculative_beam': lambda i: setup.speculative_beam([i], beam, spec,
                                                                   drafter_name)}
  timed = {}
  totals = measure.time_side_by_side(decoders, num_examples, repeats, timed)
  vocab = corpora.Vocabulary()
  targets = [e['targets'] for e in corpora.load_split(setup.task, 'test')[:num_examples]]
  row = {'task': setup.task, 'drafter': drafter_name, 'num_beams': beam.num_beams,
         'draft_beams': spec.draft_width(beam.num_beams), 'gamma': spec.gamma,
         'brevity_alpha': beam.alpha, 'examples': num_examples, 'repeats': repeats,
         **measure.beam_comparison(timed['beam'], timed['speculative_beam']),
         'beam_seconds': float(np.median(totals['beam'])),
         'speculative_beam_seconds': float(np.median(totals['speculative_beam']))}
  row['speedup'] = row['beam_seconds'] / row['speculative_beam_seconds']
  for name in ('beam', 'speculative_beam'):
    outputs = [o if name == 'beam' else o.output for o in timed[name]]
    predictions = [vocab.decode(t) for o in outputs for t in measure.best_beam_tokens(o)]
    for score, value in infer_script.task_scores(metrics.TASK_METRICS[setup.task], targets,
                                                 predictions).items():
      row[f'{name}_{score}'] = value
  return row


# ---------------------------------------------------------------------------
# Output.


def options_section(setup: Setup, drafter_name, gamma, confidence_threshold, num_drafts,
                    temperatures, num_examples, repeats) -> list[dict]:
  """Tokens per target call and walltime of plain, block, adaptive-gamma and multi-draft
  speculative decoding, side by side on the same examples and keys, batch 1, each
  timed interleaved with the others and the baseline example by example (median of
  repeats)."""
  rows = []
  specs = measure.verification_option_specs(gamma, confidence_threshold, num_drafts)
  for temperature in temperatures:
    sampling = SamplingConfig(temperature=temperature)
    decode = lambda spec, i: setup.speculative([i], sampling, drafter_name, gamma,  # noqa: E731
                                               spec=spec)
    baseline = lambda i: setup.baseline([i], sampling)  # noqa: E731
    for row in measure.compare_verification_options(decode, specs, num_examples, repeats,
                                                    baseline):
      rows.append({'task': setup.task, 'drafter': drafter_name, 'temperature': temperature,
                   **row, 'examples': num_examples, 'repeats': repeats})
  return rows


def results_markdown(results: dict) -> str:
  machine = results['machine']
  parts = [f"## {results['task']}: target {results['target']}\n",
           f"Measured {machine['date']} on {machine['device']} ({machine['cpu']}, "
           f"{machine['cpu_count']} cores), jax {machine['jax']}, "
           f"{results['compute_dtype']}.\n"]
  if 'table2' in results:
    parts += ['\n### Table 2: walltime speedup, batch 1\n',
              'identical_outputs counts outputs equal to the baseline\'s token for token: all '
              'of them at temperature 0; at temperature 1 both decoders sample the same '
              'distribution with different draws, so few coincide.\n\n',
              inference.markdown_table(results['table2'], [
                  'task', 'drafter', 'temperature', 'gamma', 'alpha',
                  'tokens_per_target_call', 'speedup', 'identical_outputs', 'examples'])]
  if 'alpha' in results:
    rows = [dict(r, **{f'l={l}': a for l, a in r['alpha_by_lenience'].items()})
            for r in results['alpha']]
    lenience_columns = [f'l={l}' for l in results['alpha'][0]['alpha_by_lenience']][1:]
    splits = ' + '.join(results.get('alpha_splits', ['test']))
    parts += ['\n### Table 3 and Table 5: alpha (lenience l < 1 changes the output)\n',
              f'Target outputs decoded from the {splits} inputs.\n\n',
              inference.markdown_table(rows, ['drafter', 'temperature', 'alpha', 'positions']
                             + lenience_columns)]
  if 'table4' in results:
    parts += ['\n### Table 4: cost coefficient and expected vs measured speedup\n',
              'verify_cost: one target step over gamma + 1 positions / one over 1 position '
              '(Theorem 3.8 takes it as 1). measured_cost_speedup predicts from the '
              'measured proposal and verification times.\n\n',
              inference.markdown_table(results['table4'], [
                  'drafter', 'temperature', 'gamma', 'alpha', 'c', 'verify_cost',
                  'theorem_3_8_speedup', 'measured_cost_speedup', 'empirical_speedup'])]
  if 'sweep' in results:
    sweep = results['sweep']
    parts += [f"\n### Figure 3: speedup against gamma ({sweep['drafter']}, temperature 0, "
              f"alpha {sweep['alpha']:.3f}, c {sweep['c']:.3f}; optimal gamma: Theorem 3.8 "
              f"{sweep['theorem_3_8_optimal_gamma']}, measured costs "
              f"{sweep['measured_cost_optimal_gamma']})\n",
              inference.markdown_table(sweep['rows'], ['gamma', 'measured_speedup',
                                             'theorem_3_8_speedup', 'measured_cost_speedup'])]
  if 'batch' in results:
    parts += ['\n### Batch size: tokens/s, temperature 0\n',
              inference.markdown_table(results['batch'], [
                  'batch_size', 'drafter', 'gamma', 'baseline_tokens_per_second',
                  'speculative_tokens_per_second', 'speedup'])]
  if 'reference' in results:
    parts += ['\n### Baseline against a T5X-style decode loop (cross-attention K/V per step)\n',
              inference.markdown_table(results['reference'], [
                  'temperature', 'baseline_speedup', 'identical_outputs', 'examples'])]
  if 'options' in results:
    parts += ['\n### Verification options: tokens per target call, same examples and keys\n',
              'plain: token-wise (Algorithm 1); block: block verification; coupled: drafts '
              "and target draw each position with the baseline's noise (its alpha is the "
              'agreement rate); adaptive: rows '
              'stop drafting below the draft confidence threshold (gamma the maximum); '
              'multi-draft k: k branches verified in one target step (temperature 0: a '
              'top-k tree). All are exact. speedups: ratios of median walltimes, batch 1, '
              'every option and the baseline interleaved example by example.\n\n',
              inference.markdown_table(results['options'], [
                  'drafter', 'temperature', 'option', 'gamma', 'draft_confidence_threshold',
                  'tokens_per_target_call', 'accepted_per_iteration',
                  'drafted_per_iteration', 'alpha', 'speedup_vs_plain',
                  'speedup_vs_baseline', 'examples', 'repeats'])]
  if 'beam' in results:
    row = results['beam']
    scores = [k for k in row if k.startswith(('beam_', 'speculative_beam_'))
              and not k.endswith(('_seconds', '_calls', '_per_token'))]
    parts += ['\n### Beam search against speculative beam search, batch 1\n',
              'target calls: decode calls of the target (plain: one per search step); per '
              'token: over the best beams\' output tokens. speedup: beam search\'s median '
              'walltime over speculative beam search\'s, interleaved example by example. '
              'identical: examples whose beams agree in tokens, and in tokens and scores '
              'exactly.\n\n',
              inference.markdown_table([row], [
                  'task', 'drafter', 'num_beams', 'draft_beams', 'gamma', 'brevity_alpha',
                  'beam_target_calls_per_token', 'speculative_beam_target_calls_per_token',
                  'search_steps_per_target_call', 'speedup', 'identical_tokens',
                  'identical_tokens_and_scores', 'max_score_difference', 'examples']
                  + scores)]
  return ''.join(parts)


def write_plots(results: dict, output_dir: str):
  """figure3_gamma.png and batch_size.png, if matplotlib is installed (extra 'bench')."""
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed (pip install -e '.[bench]'): no plots written")
    return
  if 'sweep' in results:
    rows = results['sweep']['rows']
    gammas = [r['gamma'] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label in [('measured_speedup', 'measured'),
                       ('theorem_3_8_speedup', 'Theorem 3.8'),
                       ('measured_cost_speedup', 'measured costs')]:
      ax.plot(gammas, [r[key] for r in rows], marker='o', label=label)
    ax.axhline(1.0, color='gray', linewidth=0.5)
    ax.set_xlabel('gamma')
    ax.set_ylabel('walltime speedup')
    ax.set_title(f"{results['task']}: {results['sweep']['drafter']}, "
                 f"alpha {results['sweep']['alpha']:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(output_dir, 'figure3_gamma.png'), dpi=100)
    plt.close(fig)
  if 'batch' in results:
    rows = results['batch']
    fig, ax = plt.subplots(figsize=(5, 3.5))
    sizes = [r['batch_size'] for r in rows]
    ax.plot(sizes, [r['baseline_tokens_per_second'] for r in rows], marker='o', label='baseline')
    ax.plot(sizes, [r['speculative_tokens_per_second'] for r in rows], marker='o',
            label='speculative')
    ax.set_xscale('log', base=2)
    ax.set_xlabel('batch size')
    ax.set_ylabel('tokens/s')
    ax.set_title(f"{results['task']}: throughput, temperature 0")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(output_dir, 'batch_size.png'), dpi=100)
    plt.close(fig)


@gin.configurable
def benchmark(*, task: str = gin.REQUIRED, target_model: T5Config = gin.REQUIRED,
              target_checkpoint: str = gin.REQUIRED, target_name: str = 'local target',
              t5_drafts: dict = gin.REQUIRED, draft_checkpoints: dict = gin.REQUIRED,
              other_drafters=tuple(OTHER_DRAFTERS), shared_encoder_drafts: dict | None = None,
              output_dir: str = gin.REQUIRED, input_length: int = 64,
              max_decode_length: int = 64, temperatures=(0.0, 1.0), max_gamma: int = 10,
              alpha_tokens: int = 10000, alpha_splits=('test',),
              lenience=(1.0, 0.5, 0.3, 0.1),
              walltime_drafters=None, walltime_examples: int = 100, repeats: int = 3,
              step_repeats: int = 5, sweep_drafter: str | None = None,
              sweep_examples: int = 40, batch_sizes=(1, 4, 16),
              batch_examples: int = 64, reference_examples: int = 50,
              options_gamma: int = 4, options_confidence_threshold: float = 0.5,
              options_num_drafts=(2, 3), options_temperatures=(0.0, 1.0),
              options_examples: int = 100,
              beam: BeamConfig = BeamConfig(),
              speculative_beam: SpeculativeBeamConfig = SpeculativeBeamConfig(),
              beam_drafter: str | None = None, beam_examples: int = 20,
              sections=DEFAULT_SECTIONS) -> dict:
  """Runs the sections and writes results.json, results.md and plots to output_dir.

  alpha_splits: the held-out splits whose inputs the target decodes for alpha, in order,
  until alpha_tokens positions (a small test split can be followed by validation; never
  train, which the drafts and n-gram tables were fitted on).
  options_*: the 'options' section (tokens per target call and walltime of plain / block /
  adaptive / multi-draft verification, k branches for each k in options_num_drafts, for
  the sweep drafter, on the first options_examples test examples, `repeats` times).
  shared_encoder_drafts: name -> SharedEncoderDrafter, its checkpoint in
  draft_checkpoints[name]; reported as 'shared encoder <name>'; or an Int8Drafter (no
  checkpoint: made from the target's), reported as 'int8 <name>'.
  beam, speculative_beam, beam_drafter, beam_examples: the 'beam' section (not run by
  default): beam search with `beam` against speculative beam search with
  `speculative_beam` and the T5 draft beam_drafter ('t5 <name>'; default the last T5
  draft) on the first beam_examples test examples (gin/decoding/beam.gin's macros).
  """
  if 'train' in alpha_splits:
    raise errors.InvalidSetting('alpha_splits must be held out: the drafters were fitted on train')
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    raise errors.InvalidSetting(f'unknown sections {sorted(unknown)}; known: {SECTIONS}')
  unknown = set(other_drafters) - set(OTHER_DRAFTERS)
  if unknown:
    raise errors.InvalidSetting(
        f'unknown other_drafters {sorted(unknown)}; known: {tuple(OTHER_DRAFTERS)}')
  setup = Setup(task, target_model, target_checkpoint, t5_drafts, draft_checkpoints,
                other_drafters, input_length, max_decode_length, tuple(alpha_splits),
                shared_encoder_drafts)
  walltime_drafters = list(walltime_drafters or (
      [f't5 {n}' for n in t5_drafts]
      + [shared_encoder_label(n, d) for n, d in (shared_encoder_drafts or {}).items()]))
  sweep_drafter = sweep_drafter or walltime_drafters[-1]
  results = {'task': task, 'target': target_name, 'machine': machine_description(),
             'compute_dtype': target_model.dtype, 'input_length': input_length,
             'alpha_splits': list(alpha_splits),
             'max_decode_length': max_decode_length}
  need_alpha = {'alpha', 'table2', 'sweep', 'batch'} & set(sections)
  need_costs = {'costs', 'table2', 'sweep', 'batch'} & set(sections)
  if need_alpha:
    results['alpha'] = alpha_section(setup, temperatures, alpha_tokens, lenience)
  alphas = {(r['drafter'], r['temperature']): r['alpha'] for r in results.get('alpha', [])}
  if need_costs:
    results['costs'] = costs_section(setup, max_gamma, step_repeats)
  if 'table2' in sections:
    results['table2'] = table2_section(setup, alphas, results['costs'], temperatures,
                                       walltime_drafters, max_gamma, walltime_examples, repeats)
    results['table4'] = table4_rows(results['table2'], results['costs'])
  if 'sweep' in sections:
    results['sweep'] = sweep_section(setup, alphas[(sweep_drafter, 0.0)], results['costs'],
                                     sweep_drafter, max_gamma, sweep_examples, repeats)
  if 'batch' in sections:
    gamma = best_gamma(alphas[(sweep_drafter, 0.0)], results['costs'], sweep_drafter, max_gamma)
    results['batch'] = batch_section(setup, sweep_drafter, gamma, batch_sizes, batch_examples,
                                     repeats)
  if 'reference' in sections:
    results['reference'] = reference_section(setup, temperatures, reference_examples, repeats)
  if 'options' in sections:
    results['options'] = options_section(setup, sweep_drafter, options_gamma,
                                         options_confidence_threshold, options_num_drafts,
                                         options_temperatures, options_examples, repeats)
  if 'beam' in sections:
    results['beam'] = beam_section(setup, beam_drafter or f't5 {list(t5_drafts)[-1]}', beam,
                                   speculative_beam, beam_examples, repeats)
  inference.write_text_atomic(os.path.join(output_dir, 'results.json'),
                              json.dumps(results, indent=2, default=str))
  markdown = results_markdown(results)
  inference.write_text_atomic(os.path.join(output_dir, 'results.md'), markdown)
  write_plots(results, output_dir)
  print(markdown)
  return results


def main(argv: list[str] | None = None):
  argv = sys.argv[1:] if argv is None else argv
  gin_files = [a for a in argv if a.startswith('--gin_file')]
  rest = [a for a in argv if not a.startswith('--gin_file')]
  runs = gin_files and [gin_files] or [[f'--gin_file={f}'] for f in DEFAULT_GIN_FILES]
  for files in runs:
    gin.clear_config()
    gin_flags.parse(files + rest, description=__doc__.split('\n\n')[0],
                    config_dirs=('benchmark',))
    benchmark()


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

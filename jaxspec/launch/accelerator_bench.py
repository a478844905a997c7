"""One command that measures what speculative decoding costs on the device JAX sees.

  python scripts/accelerator_bench.py                  # or: jaxspec-accelerator-bench
  python scripts/accelerator_bench.py --parts=a,c --sizes=base,xxl
  python scripts/accelerator_bench.py --tiny           # tiny shapes: seconds on a CPU

Parts (--parts, in this order; each under a share of --budget_s, what a part leaves
unused going to the later ones, and the items past a part's deadline skipped and named):
  p  where the time goes (jaxspec.measure.profile): a jax.profiler trace of the
     speculative loop (T5.1.1 --loop_size target, small draft, batch 1, greedy), of a
     run of proposals and of verify steps, in each draft loop form (early exit, static
     trip count): kernels per draft step and per verify step, device-to-host copies and
     host waits per iteration, the device's idle time between kernels, and each form's
     time per iteration and per proposal. On a GPU the same again under XLA flag
     variants (command buffers with WHILE and CONDITIONAL, graph size, loop unrolling),
     each in a child process of this command (XLA reads its flags once, at start-up);
     a flag the installed XLA refuses is recorded as refused.
  a  bfloat16 step costs at T5.1.1 shapes (--sizes of base, large, xl, xxl; vocab 32128;
     random weights), at each of --batch_sizes: the one-position cached decode step,
     V(k) = step over k positions / step over 1 for k in --positions, the proposal of
     gamma tokens by T5.1.1-small and by the target's own decoder in int8 (jaxspec's
     Int8Drafter, through plain XLA), hence c = draft step / target step; and the
     fraction of the device's peak memory bandwidth each step reaches (the bytes of
     weights and cache a step reads / its time / the peak of PEAK_BANDWIDTH). Each of
     --variants times the target's steps over 1 and gamma + 1 positions and the small
     draft's step again with one change undone or made (T5X's unfused kernels; the
     attention through jax.nn.dot_product_attention), interleaved with the rest.
  b  the jitted speculative loop per iteration against a proposal and a verify step
     timed apart (T5.1.1 --loop_size target, small draft, batch 1): the while loop's
     overhead on this device.
  c  the paper's Table 2 (T5-XXL target; small, base and large drafts; EnDe and CNNDM;
     T=0 and 1) predicted from part a's c and V(gamma + 1) with the paper's alphas
     (Table 3), the best gamma per row, beside the paper's walltime speedups; and the
     best chain and the best token tree (num_drafts x gamma) sized from the measured
     V(k) (jaxspec.measure.tree_sizing), side by side.
  d  end to end in each of --dtypes (bfloat16, float32): the baseline and speculative
     decoding (the --pair's small draft) at each batch size, T=0 and 1, over the first
     --examples validation inputs: tokens/s, speedup, identical greedy outputs within
     each dtype; for each of --decode_positions (the target's fixed step width; default
     gamma + 1). In the first dtype at T=0 also gamma='auto' (choosing among 0, the
     baseline, and --auto_gammas, calibrated on the same inputs): its speedup, whether
     it chose the baseline, identical outputs.
  e  the drafters that make sense on the device, in bfloat16 at batch 1: the target's
     int8 self-draft through XLA and the trained T5 drafts: c (proposal / gamma target
     steps), alpha and the speedup measured end to end, and the speedup those predict.

Writes <output_dir>/<device-slug>.json and .md after every part (and every item of
part a), so a run cut off keeps what it measured; prints a summary. --tiny runs every
part at tiny random shapes (tests/test_accelerator_bench.py) and writes
<device-slug>-tiny.*. docs/usage/accelerator.md has more.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import inference, machine
from jaxspec.config import (CPU_MATMULS, CPU_MATMUL_XLA, DECODE_ATTENTION_EINSUM,
                            DECODE_ATTENTION_JAX, get_config)
from jaxspec.decoding.drafters import Int8Drafter, SharedEncoderDrafterWithTarget, T5Drafter
from jaxspec.decoding.drafters import loops as draft_loops
from jaxspec.decoding.drafters.feature import FeatureDrafter, FeatureDrafterWithTarget
from jaxspec.measure import accelerator, step_costs
from jaxspec.measure import profile as profile_lib
from jaxspec.model import feature_draft
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model.cpu import matmul as cpu_matmul_lib
from jaxspec.launch import command

PARTS = ('p', 'a', 'b', 'c', 'd', 'e')
PART_NAMES = {'p': 'profile', 'a': 'step_costs', 'b': 'loop_overhead', 'c': 'table2',
              'd': 'end_to_end', 'e': 'drafters'}
# Shares of the budget: step costs compile the most programs (a decode loop per size,
# batch and k), the end-to-end parts a decode loop per dtype, batch and temperature;
# the profile two speculative loops and their parts, then a child process per variant.
SHARES = {'p': 0.25, 'a': 0.45, 'b': 0.1, 'c': 0.0, 'd': 0.25, 'e': 0.2}
# Part p's XLA flag variants on a GPU (--profile_variants=auto), each run in a child
# process: XLA:GPU's command buffers (CUDA graphs) with WHILE and CONDITIONAL, which can
# keep a loop's condition on the device; with every graph captured however small; with
# loops of known trip count unrolled into the graph.
COMMAND_BUFFER_WHILE = '--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL'
GPU_FLAG_VARIANTS = {
    'command_buffer_while': COMMAND_BUFFER_WHILE,
    'command_buffer_while_min_graph_1': f'{COMMAND_BUFFER_WHILE} --xla_gpu_graph_min_graph_size=1',
    'command_buffer_while_unrolled': (f'{COMMAND_BUFFER_WHILE} '
                                      '--xla_gpu_command_buffer_unroll_loops=true'),
}
# Seconds a child process takes beyond the compiles measured in this one (start-up,
# imports, the device's initialization, timing and traces).
CHILD_OVERHEAD_S = 20.0
# Part a's A/B items: name -> (kernel layout, None for the run's own; decode_attention).
VARIANTS = {'t5x_layout': (kernel_layout.T5X, DECODE_ATTENTION_EINSUM),
            'dot_product_attention': (None, DECODE_ATTENTION_JAX)}
SIZES = {'small': 't5_1_1_small', 'base': 't5_1_1_base', 'large': 't5_1_1_large',
         'xl': 't5_1_1_xl', 'xxl': 't5_1_1_xxl'}
TARGET_SIZES = ('base', 'large', 'xl', 'xxl')
TINY_TARGET, TINY_DRAFT = 'test_tiny_1_1', 'test_tiny_1_0'
TINY_LAYERS = {'num_encoder_layers': 1, 'num_decoder_layers': 1}  # --tiny compiles less
TINY_SIZE = 'tiny'
DTYPES = ('bfloat16', 'float32')  # part d; the accelerators' own first
TEMPERATURES = (0.0, 1.0)
# The shipped feature head's alpha at T = 0 over the whole EnDe test split (jaxspec-infer
# with configs/infer/ende54m_feature.gin at gamma 3, results/feature_head/whole_split/t0.json),
# part c's stand-in for a head over T5-XXL.
FEATURE_ALPHA = 0.642
DEFAULT_POSITIONS = '2,4,6,8,9,16,32,64'
# gamma='auto' must decode at least this fraction of the baseline's speed (part d).
AUTO_FLOOR = 0.97


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--parts', default=','.join(PARTS),
                      help='comma-separated parts among p,a,b,c,d,e (above)')
  parser.add_argument('--sizes', default=','.join(TARGET_SIZES),
                      help=f'T5.1.1 targets of part a among {",".join(TARGET_SIZES)}')
  parser.add_argument('--budget_s', type=float, default=300.0,
                      help='wall-clock seconds for all parts, compiles included; a part '
                      'gets its share of what is left (p 25, a 45, b 10, d 25, e 20)')
  parser.add_argument('--output_dir', default=os.path.join('results', 'accelerator'))
  parser.add_argument('--tiny', action='store_true',
                      help=f'tiny random shapes ({TINY_TARGET} target, {TINY_DRAFT} draft) '
                      'in every part: the whole command in seconds on a CPU')
  parser.add_argument('--batch_sizes', default=None,
                      help='parts a and d (default 1,8; 1 with --tiny: fewer compiles)')
  parser.add_argument('--positions', default=None,
                      help='k of the verify steps timed in part a, 1 added (default '
                      '2,4,6,8,9,16,32,64: token trees verify 1 + num_drafts x gamma; '
                      '2,4 with --tiny)')
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help='part a A/B items, each timed beside the run\'s own steps: '
                      f'among {",".join(VARIANTS)} (empty: none)')
  parser.add_argument('--gamma', type=int, default=3,
                      help='draft tokens per proposal in parts a, b, d and e')
  parser.add_argument('--repeats', type=int, default=None,
                      help='timed repetitions (default 10; 3 with --tiny)')
  parser.add_argument('--loop_size', default=None,
                      help='the T5.1.1 target of part b (default: the first of --sizes)')
  parser.add_argument('--loop_length', type=int, default=None,
                      help='max_decode_length of part b (default 64; 16 with --tiny)')
  parser.add_argument('--pair', default='ende_local',
                      help='the shipped pair of parts d and e (jaxspec.pairs)')
  parser.add_argument('--examples', type=int, default=8,
                      help='validation inputs decoded in parts d and e')
  parser.add_argument('--max_decode_length', type=int, default=None,
                      help="parts d and e (default: the pair's; 16 with --tiny)")
  parser.add_argument('--cpu_matmul', default=CPU_MATMUL_XLA, choices=CPU_MATMULS,
                      help="T5Config.cpu_matmul: 'xla' (default) runs what an accelerator "
                      "runs on a CPU too; 'kernel' lets a CPU use jaxspec's kernel "
                      '(inert off-CPU either way)')
  parser.add_argument('--decode_positions', default='gamma',
                      help="the target's T5Config.decode_positions in parts d and e, a "
                      "comma-separated list (part d runs each; e the last): 0 (steps as "
                      "wide as their tokens) or a width; 'gamma' is gamma + 1, the width "
                      'that keeps greedy outputs identical (default)')
  parser.add_argument('--dtypes', default=','.join(DTYPES),
                      help=f'part d\'s dtypes, among {",".join(DTYPES)}')
  parser.add_argument('--auto_gammas', default='gamma',
                      help="part d: gamma='auto' chooses among 0 and these (in the first "
                      "dtype, T=0); 'gamma' is 1..gamma (every one within the fixed-width "
                      "steps; gamma alone with --tiny), empty: no gamma='auto' rows")
  parser.add_argument('--feature_alpha', type=float, default=FEATURE_ALPHA,
                      help="part c's alpha of the feature-level head (jaxspec.FeatureDrafter; "
                      'default: the EnDe T=0 alpha measured on the CPU for the shipped head)')
  parser.add_argument('--profile_loops', default='early_exit,static',
                      help='part p: the draft loop forms profiled (SpeculativeConfig.draft_loop)')
  parser.add_argument('--profile_variants', default='auto',
                      help="part p: XLA flag variants, each profiled in a child process: "
                      "'auto' (on a GPU: GPU_FLAG_VARIANTS; elsewhere none), 'none', or "
                      "'name=--flag=value --flag=value;name=...'")
  parser.add_argument('--profile_child', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--seed', type=int, default=0)
  command.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  args.parts = [p for p in args.parts.split(',') if p]
  unknown = sorted(set(args.parts) - set(PARTS))
  if unknown:
    parser.error(f'unknown parts {unknown}; known: {",".join(PARTS)}')
  args.parts = [p for p in PARTS if p in args.parts]
  args.sizes = [s for s in args.sizes.split(',') if s]
  if args.tiny:
    args.sizes = [TINY_SIZE]
  elif set(args.sizes) - set(TARGET_SIZES):
    parser.error(f'unknown sizes {sorted(set(args.sizes) - set(TARGET_SIZES))}; '
                 f'known: {",".join(TARGET_SIZES)}')
  args.batch_sizes = [int(b) for b in (args.batch_sizes or ('1' if args.tiny else '1,8'))
                      .split(',') if b]
  args.positions = sorted({int(k) for k in (args.positions or ('2,4' if args.tiny else
                                                                 DEFAULT_POSITIONS)).split(',')
                           if k} - {1})
  args.variants = [v for v in args.variants.split(',') if v]
  if set(args.variants) - set(VARIANTS):
    parser.error(f'unknown variants {sorted(set(args.variants) - set(VARIANTS))}; known: '
                 f'{",".join(VARIANTS)}')
  args.dtypes = [d for d in args.dtypes.split(',') if d]
  if not args.dtypes or set(args.dtypes) - set(DTYPES):
    parser.error(f'--dtypes: among {",".join(DTYPES)}')
  try:  # 'gamma': 1..gamma (gamma alone with --tiny: no programs beyond part d's own)
    args.auto_gammas = (([args.gamma] if args.tiny else list(range(1, args.gamma + 1)))
                        if args.auto_gammas == 'gamma' else
                        sorted({int(g) for g in args.auto_gammas.split(',') if g}))
  except ValueError:
    parser.error(f"--auto_gammas takes integers or 'gamma', got {args.auto_gammas!r}")
  if any(g < 1 for g in args.auto_gammas):
    parser.error('--auto_gammas: each >= 1 (0, the baseline, is always a choice)')
  if any(k < 2 for k in args.positions) or any(b < 1 for b in args.batch_sizes):
    parser.error('positions must be >= 2 and batch sizes >= 1')
  if args.gamma < 1:
    parser.error('gamma must be >= 1')
  try:
    args.decode_positions = [args.gamma + 1 if w == 'gamma' else int(w)
                             for w in args.decode_positions.split(',') if w]
  except ValueError:
    parser.error(f"--decode_positions takes integers or 'gamma', got {args.decode_positions!r}")
  if not args.decode_positions or any(
      w != 0 and w < args.gamma + 1 for w in args.decode_positions):
    parser.error(f'--decode_positions: each 0 or at least gamma + 1 = {args.gamma + 1}')
  args.repeats = args.repeats or (3 if args.tiny else 10)
  args.loop_size = args.loop_size or args.sizes[0]
  if not args.tiny and args.loop_size not in TARGET_SIZES:
    parser.error(f'--loop_size must be one of {",".join(TARGET_SIZES)}')
  args.loop_length = args.loop_length or (16 if args.tiny else 64)
  args.profile_loops = [f for f in args.profile_loops.split(',') if f]
  if not args.profile_loops or set(args.profile_loops) - {'early_exit', 'static'}:
    parser.error("--profile_loops: a list of 'early_exit' and 'static'")
  try:
    args.profile_variants = _parse_variants(args.profile_variants)
  except ValueError as error:
    parser.error(str(error))
  return args


def _parse_variants(text: str):
  """'auto' (the platform's, chosen once the device is known), 'none' or
  'name=flags;name=flags' -> 'auto' or {name: flags}."""
  if text == 'auto':
    return text
  variants = {}
  for item in (t.strip() for t in text.split(';') if text != 'none'):
    name, _, flags = item.partition('=')
    if not item or not name or not flags.strip().startswith('--'):
      raise ValueError(f"--profile_variants: 'name=--flag=value ...' items, got {item!r}")
    variants[name.strip()] = flags.strip()
  return variants


@dataclasses.dataclass
class Run:
  """One invocation: its settings, budget, the record written after every part."""
  args: argparse.Namespace
  budget: accelerator.Budget
  record: dict
  json_path: str
  md_path: str
  peak: float | None

  def config(self, size: str, dtype: str = 'bfloat16'):
    """The config of a part-a size ('small', a target size, or 'tiny' / the tiny draft)."""
    overrides = dict(dtype=dtype, param_dtype=dtype, cpu_matmul=self.args.cpu_matmul)
    if self.args.tiny:
      return get_config(TINY_DRAFT if size == 'small' else TINY_TARGET, **overrides,
                        **TINY_LAYERS)
    return get_config(SIZES[size], **overrides)

  def setup(self, batch: int, source_length: int | None = None) -> step_costs.StepCostSetup:
    """Part a's steps run from cache_position, in a cache that holds the widest verify
    step of --positions after it."""
    position, length = (3, 16) if self.args.tiny else (20, 64)
    length = max(length, position + max(self.args.positions, default=1))
    if self.args.tiny:
      return step_costs.StepCostSetup(batch_size=batch, source_length=source_length or 6,
                                      cache_position=position, cache_length=length,
                                      steps_per_call=2, repeats=self.args.repeats)
    return step_costs.StepCostSetup(batch_size=batch, source_length=source_length or 40,
                                    cache_position=position, cache_length=length,
                                    steps_per_call=10, repeats=self.args.repeats)

  def write(self) -> None:
    """The record as JSON and markdown, each replaced atomically."""
    inference.write_text_atomic(self.json_path, json.dumps(_jsonable(self.record), indent=1)
                                + '\n')
    inference.write_text_atomic(self.md_path, markdown(self.record))


def _jsonable(value):
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.floating, np.integer, np.bool_)):
    return value.item()
  if isinstance(value, float) and not np.isfinite(value):
    return None
  return value


def _error(error: BaseException) -> dict:
  traceback.print_exception(error, file=sys.stderr)
  return {'error': f'{type(error).__name__}: {error}'}


# ---------------------------------------------------------------------------
# Part a: step costs.


def _variant(params, config, name: str):
  """(params, config) of a part-a variant (VARIANTS): params in its layout (the run's own
  where it names none), config with its decode_attention."""
  layout, attention = VARIANTS[name]
  return (params if layout is None else kernel_layout.to_layout(params, layout),
          config.replace(decode_attention=attention))


def _variant_calls(run: Run, params, config, setup, cache, positions
                   ) -> tuple[dict, dict[str, str]]:
  """({('variant', name, k): call}, {name: error}) for each of --variants: its steps over
  `positions`, each run once here (it compiles), so a variant the device refuses (a
  kernel it lacks) is recorded and the item's other calls still run."""
  calls, errors = {}, {}
  for name in run.args.variants:
    try:
      variant_params, variant_config = _variant(params, config, name)
      named = {('variant', name, k): call for k, call in accelerator.step_calls(
          variant_params, variant_config, setup, positions, cache).items()}
      for call in named.values():
        jax.block_until_ready(call())
      calls.update(named)
    except Exception as error:  # noqa: BLE001
      errors[name] = _error(error)['error']
  return calls, errors


def _variant_entries(run: Run, times, setup, positions, errors) -> dict:
  """{variant: {'step_ms' (k = 1), 'verify_ms' (the widest of positions), and their
  ratios to the run's own steps (median over repetitions; > 1: the variant is slower)}
  or {'error'}}."""
  out = {}
  for name in run.args.variants:
    if name in errors:
      out[name] = {'error': errors[name]}
      continue
    layout, attention = VARIANTS[name]
    entry = {'layout': layout or kernel_layout.decode_layout(), 'decode_attention': attention}
    for field, k in (('step', 1), ('verify', max(positions))):
      if k == 1 and field == 'verify':
        continue
      entry[f'{field}_ms'] = 1e3 * accelerator.step_seconds(times, ('variant', name, k), setup)
      entry[f'{field}_ratio'] = accelerator.ratio(times, ('variant', name, k), ('step', k))
    out[name] = entry
  return out


def _measure_draft(run: Run, batch: int) -> dict:
  """T5.1.1-small (the tiny draft with --tiny): its one-position step and proposal, and
  its step in each of --variants."""
  args = run.args
  setup = run.setup(batch)
  config = run.config('small')
  params = accelerator.random_params(config, args.seed + 2)
  cache = accelerator.empty_cache(params, config, setup)
  calls = {('step', 1): accelerator.step_calls(params, config, setup, [1], cache)[1]}
  calls.update({('proposal', n): call for n, call in accelerator.proposal_calls(
      T5Drafter(config), params, setup, args.gamma).items()})
  variant_calls, errors = _variant_calls(run, params, config, setup, cache, [1])
  times, first = accelerator.time_calls({**calls, **variant_calls}, args.repeats)
  step = accelerator.step_seconds(times, ('step', 1), setup)
  proposal = accelerator.slope_seconds(times, ('proposal',))
  step_bytes = accelerator.decode_step_bytes(params, config, cache)
  return {'config': config_name(run, 'small'), 'parameters': accelerator.parameter_count(params),
          'step_bytes': step_bytes, 'step_ms': 1e3 * step, 'proposal_ms': 1e3 * proposal,
          'bandwidth_fraction': accelerator.bandwidth_fraction(step_bytes, step, run.peak),
          'variants': _variant_entries(run, times, setup, [1], errors),
          'first_calls_s': first}


def config_name(run: Run, size: str) -> str:
  if run.args.tiny:
    return (TINY_DRAFT if size == 'small' else TINY_TARGET) + ' (1 layer)'
  return SIZES[size]


def _measure_target(run: Run, size: str, batch: int, draft: dict | None) -> dict:
  """One target at one batch size: its steps over 1 and each of --positions positions,
  and its int8 draft's proposals, interleaved."""
  args = run.args
  setup = run.setup(batch)
  config = run.config(size)
  params = accelerator.random_params(config, args.seed)
  cache = accelerator.empty_cache(params, config, setup)
  positions = [1] + args.positions
  calls = {('step', k): call for k, call in accelerator.step_calls(
      params, config, setup, positions, cache).items()}
  int8_params = accelerator.random_int8_draft_params(params, args.seed + 1)
  int8 = SharedEncoderDrafterWithTarget(Int8Drafter(config), config)
  calls.update({('int8', n): call for n, call in accelerator.proposal_calls(
      int8, {'draft': int8_params, 'target': params}, setup, args.gamma).items()})
  head, head_params = _feature_head(config, params, args.seed + 2)
  calls.update({('feature', n): call for n, call in accelerator.proposal_calls(
      head, {'draft': head_params, 'target': params}, setup, args.gamma).items()})
  variant_positions = [1, args.gamma + 1]
  variant_calls, errors = _variant_calls(run, params, config, setup, cache, variant_positions)
  if variant_calls:  # the run's own steps beside them
    calls.update({('step', k): call for k, call in accelerator.step_calls(
        params, config, setup, variant_positions, cache).items() if ('step', k) not in calls})
  times, first = accelerator.time_calls({**calls, **variant_calls}, args.repeats)
  step_bytes = accelerator.decode_step_bytes(params, config, cache)
  step = accelerator.step_seconds(times, ('step', 1), setup)
  steps = {}
  for k in positions:
    seconds = accelerator.step_seconds(times, ('step', k), setup)
    steps[k] = {'ms': 1e3 * seconds, 'V': accelerator.ratio(times, ('step', k), ('step', 1)),
                'bandwidth_fraction': accelerator.bandwidth_fraction(step_bytes, seconds,
                                                                     run.peak)}
  proposal = accelerator.slope_seconds(times, ('int8',))
  int8_bytes = accelerator.decode_step_bytes(int8_params, config, cache)
  entry = {
      'config': config_name(run, size), 'parameters': accelerator.parameter_count(params),
      'step_bytes': step_bytes, 'steps': steps,
      'int8_draft': {
          'proposal_ms': 1e3 * proposal, 'c': proposal / (args.gamma * step),
          'step_bytes': int8_bytes,
          'bandwidth_fraction': accelerator.bandwidth_fraction(
              args.gamma * int8_bytes, proposal, run.peak)},
      'feature_head': _feature_entry(times, args.gamma, step),
      'variants': _variant_entries(run, times, setup, variant_positions, errors),
      'first_calls_s': first}
  if draft and 'step_ms' in draft:
    entry['small_draft'] = {'c': draft['step_ms'] / (1e3 * step),
                            'c_from_proposal': draft['proposal_ms'] / (1e3 * args.gamma * step)}
  return entry


def _feature_head(config, target_params, seed: int):
  """A feature-level head of one layer at the target's shapes (jaxspec.FeatureDrafter:
  one decoder layer of its width over its features, its LM head), random weights in the
  target's dtype and the platform's decoding layout, made stand-alone for timing."""
  drafter = FeatureDrafter(config)
  head = feature_draft.init_params(drafter.head_config, jax.random.PRNGKey(seed))['params']
  head = jax.tree_util.tree_map(lambda x: x.astype(config.param_dtype), head)
  params = FeatureDrafter.make_params(head, target_params)
  return FeatureDrafterWithTarget(drafter, config), params


def _feature_entry(times, gamma: int, step: float) -> dict:
  """The head's proposal of gamma tokens and its c against the target's step."""
  proposal = accelerator.slope_seconds(times, ('feature',))
  return {'layers': 1, 'proposal_ms': 1e3 * proposal, 'c': proposal / (gamma * step)}


def part_step_costs(run: Run) -> dict:
  args = run.args
  out = {'dtype': 'bfloat16', 'gamma': args.gamma, 'positions': [1] + args.positions,
         'layout': kernel_layout.decode_layout(), 'variants': args.variants,
         'setup': {f.name: getattr(run.setup(1), f.name)
                   for f in dataclasses.fields(step_costs.StepCostSetup)
                   if f.name != 'batch_size'},
         'targets': {}, 'drafts': {'small': {}}, 'skipped': []}
  run.record['parts'][PART_NAMES['a']] = out
  estimates: dict[str, float] = {}
  previous = 0.0
  for batch in args.batch_sizes:
    key = f'batch_{batch}'
    try:
      draft = _measure_draft(run, batch)
    except Exception as error:  # noqa: BLE001  (recorded; the other items still run)
      draft = _error(error)
    out['drafts']['small'][key] = draft
    for size in args.sizes:
      estimate = estimates.get(size, previous)
      if not run.budget.allows(estimate):
        out['skipped'].append({'size': size, 'batch': batch,
                               'reason': f'over the part budget (expected ~{estimate:.0f} s)'})
        continue
      start = time.perf_counter()
      try:
        entry = _measure_target(run, size, batch, draft)
      except Exception as error:  # noqa: BLE001
        entry = _error(error)
      entry['seconds'] = time.perf_counter() - start
      estimates[size] = previous = entry['seconds']
      out['targets'].setdefault(size, {})[key] = entry
      print(f'a: {size} batch {batch}: ' + _target_line(entry), flush=True)
      run.write()
  return out


def _target_line(entry: dict) -> str:
  if 'error' in entry:
    return entry['error']
  steps = entry['steps']
  fraction = steps[1]['bandwidth_fraction']
  return (f"step {steps[1]['ms']:.3f} ms"
          + (f' ({fraction:.0%} of peak bandwidth)' if fraction is not None else '')
          + ', V ' + ' '.join(f"{k}:{s['V']:.2f}" for k, s in steps.items() if k > 1)
          + f", int8 c {entry['int8_draft']['c']:.3f}"
          + (f", small c {entry['small_draft']['c']:.3f}" if 'small_draft' in entry else '')
          + (f", head c {entry['feature_head']['c']:.3f}" if 'feature_head' in entry else ''))


# ---------------------------------------------------------------------------
# Part b: the loop against its parts.


def part_loop_overhead(run: Run) -> dict:
  args = run.args
  setup = run.setup(1)
  config, draft_config = run.config(args.loop_size), run.config('small')
  params = accelerator.random_params(config, args.seed)
  draft_params = accelerator.random_params(draft_config, args.seed + 2)
  result = accelerator.loop_overhead(
      params, config, T5Drafter(draft_config), draft_params, gamma=args.gamma,
      max_decode_length=args.loop_length, setup=setup, repeats=args.repeats, seed=args.seed)
  result.update(target=config_name(run, args.loop_size), draft=config_name(run, 'small'),
                dtype='bfloat16')
  print(f"b: iteration {result['iteration_ms']:.3f} ms = proposal {result['proposal_ms']:.3f} "
        f"+ verify {result['verify_ms']:.3f} + overhead {result['overhead_ms']:.3f} ms",
        flush=True)
  return result


# ---------------------------------------------------------------------------
# Part c: Table 2 predicted.


def part_table2(run: Run) -> dict:
  step_part = run.record['parts'].get(PART_NAMES['a'])
  if not step_part or not step_part.get('targets'):
    return {'skipped': 'needs part a (step costs) in the same run'}
  measured = [size for size in (*TARGET_SIZES, TINY_SIZE)
              if 'steps' in step_part['targets'].get(size, {}).get('batch_1', {})]
  if not measured:
    return {'skipped': 'part a measured no target at batch 1'}
  target = 'xxl' if 'xxl' in measured else measured[-1]
  target_entry = step_part['targets'][target]['batch_1']
  one = target_entry['steps'][1]['ms']
  draft_c = {'small': None, 'base': None, 'large': None}
  small = step_part['drafts']['small'].get('batch_1', {})
  if 'step_ms' in small:
    draft_c['small'] = small['step_ms'] / one
  for size in ('base', 'large'):
    if size in measured and size != target:
      draft_c[size] = step_part['targets'][size]['batch_1']['steps'][1]['ms'] / one
  verify_cost = {k: s['V'] for k, s in target_entry['steps'].items() if k > 1}
  # A tree's m branches are drafted as a batch of m rows: c by the batches measured.
  draft_steps = {'small': {int(batch.split('_')[-1]): entry['step_ms']
                           for batch, entry in step_part['drafts']['small'].items()
                           if 'step_ms' in entry}}
  for size in ('base', 'large'):
    if size in measured and size != target:
      draft_steps[size] = {int(batch.split('_')[-1]): entry['steps'][1]['ms']
                           for batch, entry in step_part['targets'][size].items()
                           if 'steps' in entry}
  branch_c = {draft: accelerator.draft_cost_by_branches(steps, one)
              for draft, steps in draft_steps.items() if steps}
  rows = accelerator.table2_predictions(draft_c, verify_cost, branch_c=branch_c)
  if 'feature_head' in target_entry:
    draft_c['feature head'] = target_entry['feature_head']['c']
    rows += accelerator.table2_predictions(draft_c, verify_cost, rows=(
        {'task': 'EnDe', 'draft': 'feature head', 'temperature': 0, 'paper_gamma': None,
         'alpha': run.args.feature_alpha, 'paper_speedup': None, 'paper_c': None},))
  for row in rows:
    if row['predicted_speedup'] is not None:
      print(f"c: {row['task']} {row['draft']} T={row['temperature']}: predicted "
            f"{row['predicted_speedup']:.2f}x at gamma {row['best_gamma']}; best chain "
            f"{_shape(row['best_chain'])}, best tree {_shape(row['best_tree'])} "
            + (f"(paper {row['paper_speedup']}x at {row['paper_gamma']})"
               if row['paper_speedup'] else f"(alpha {row['alpha']} measured here)"),
            flush=True)
  return {'target': config_name(run, target), 'c': draft_c, 'verify_cost': verify_cost,
          'branch_c': branch_c,
          'note': 'c = draft one-position step / target one-position step (part a, '
                  'batch 1, bfloat16); V(k) the target\'s; alpha from the paper\'s Table 3 '
                  '(the feature head\'s: --feature_alpha, measured on the CPU for the '
                  'shipped EnDe head)',
          'rows': rows}


def _shape(shape: dict | None) -> str:
  """A tree_sizing shape in words: '2.61x (4 x 5, 21 positions)'."""
  if not shape:
    return '-'
  return (f"{shape['speedup']:.2f}x ({shape['num_drafts']} x {shape['gamma']}, "
          f"{shape['positions']} positions)")


# ---------------------------------------------------------------------------
# Parts d and e: whole decodes.


def _cast(params, dtype: str):
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


@dataclasses.dataclass
class Models:
  """A target, its T5 drafts and the inputs of parts d and e, in one dtype."""
  name: str
  target_config: object
  target_params: object
  drafts: dict  # name -> (config, params)
  inputs: np.ndarray
  max_decode_length: int


def _models(run: Run, dtype: str, drafts=('small',)) -> Models:
  args = run.args
  if args.tiny:
    target_config = run.config(TINY_SIZE, 'float32').replace(dtype=dtype, param_dtype=dtype)
    draft_config = run.config('small', 'float32').replace(dtype=dtype, param_dtype=dtype)
    # The same random weights in both dtypes (made in float32, cast).
    target = _cast(accelerator.random_params(target_config.replace(param_dtype='float32'),
                                             args.seed), dtype)
    draft = _cast(accelerator.random_params(draft_config.replace(param_dtype='float32'),
                                            args.seed + 2), dtype)
    inputs = np.random.default_rng(args.seed).integers(  # part a's source length
        2, target_config.vocab_size, (args.examples, run.setup(1).source_length)
    ).astype(np.int32)
    return Models(f'{TINY_TARGET} + {TINY_DRAFT}, one layer each (random)', target_config,
                  target,
                  {'small': (draft_config, draft)}, inputs, args.max_decode_length or 16)
  from jaxspec import pairs  # pylint: disable=import-outside-toplevel
  from jaxspec.data import corpora  # pylint: disable=import-outside-toplevel
  loaded = {name: pairs.load(args.pair, name, dtype=dtype) for name in drafts}
  first = loaded[drafts[0]]
  examples = corpora.load_split(first.task, 'validation')[:args.examples]
  inputs = first.encode([example['inputs'] for example in examples])
  with_setting = lambda config: config.replace(cpu_matmul=args.cpu_matmul)  # noqa: E731
  return Models(args.pair, with_setting(first.target_config), first.target_params,
                {name: (with_setting(p.draft_config), p.draft_params)
                 for name, p in loaded.items()},
                inputs, args.max_decode_length or first.max_decode_length)


def part_end_to_end(run: Run) -> dict:
  args = run.args
  out = {'gamma': args.gamma, 'examples': args.examples, 'draft': 'small',
         'dtypes': args.dtypes, 'auto_gammas': args.auto_gammas, 'rows': [], 'skipped': []}
  run.record['parts'][PART_NAMES['d']] = out
  greedy_tokens = {}
  estimate = 0.0
  for dtype in args.dtypes:
    models = _models(run, dtype)
    out['pair'], out['max_decode_length'] = models.name, models.max_decode_length
    draft_config, draft_params = models.drafts['small']
    for width in args.decode_positions:
      target_config = models.target_config.replace(decode_positions=width)
      for batch in args.batch_sizes:
        for temperature in TEMPERATURES:
          settings = {'dtype': dtype, 'decode_positions': width, 'batch': batch,
                      'temperature': temperature}
          if not run.budget.allows(estimate):
            out['skipped'].append(dict(settings, reason='over the part budget'))
            continue
          # gamma='auto' in the first dtype, greedy, among the gammas the width verifies.
          auto_gammas = [g for g in args.auto_gammas if not width or g + 1 <= width] if (
              dtype == args.dtypes[0] and temperature == 0.0) else []
          start = time.perf_counter()
          try:
            results, first, tokens = accelerator.end_to_end(
                models.target_params, target_config,
                {'small': (T5Drafter(draft_config), draft_params)}, models.inputs,
                batch=batch, temperature=temperature, gamma=args.gamma,
                max_decode_length=models.max_decode_length, repeats=args.repeats,
                seed=args.seed, auto_gammas=auto_gammas)
            row = dict(settings, baseline=results['baseline'], speculative=results['small'],
                       first_calls_s=first)
            if 'auto' in results:
              row['auto'] = results['auto']
            if temperature == 0.0:
              greedy_tokens.setdefault(dtype, tokens['baseline'])
          except Exception as error:  # noqa: BLE001
            row = dict(_error(error), **settings)
          row['seconds'] = estimate = time.perf_counter() - start
          out['rows'].append(row)
          if 'speculative' in row:
            spec = row['speculative']
            print(f"d: {dtype} steps {width or '-'} batch {batch} T={temperature}: baseline "
                  f"{row['baseline']['tokens_per_s']:.0f} tokens/s, speculative "
                  f"{spec['tokens_per_s']:.0f} tokens/s ({spec['speedup']:.2f}x, alpha "
                  f"{spec['alpha']:.2f}, identical {spec['identical_outputs']})"
                  + (f"; gamma=auto {_auto_line(row['auto'])}" if 'auto' in row else ''),
                  flush=True)
          run.write()
  if len(greedy_tokens) == 2:
    a, b = (greedy_tokens[d] for d in DTYPES)
    out['greedy_rows_equal_across_dtypes'] = int(np.sum(np.all(a == b, axis=1)))
  out['auto'] = _auto_summary(out['rows'])
  out['greedy_identical'] = {}  # per decode_positions: every greedy row's verdict
  for width in args.decode_positions:
    greedy = [row['speculative']['identical_outputs'] for row in out['rows']
              if row.get('temperature') == 0.0 and 'speculative' in row
              and row['decode_positions'] == width]
    out['greedy_identical'][str(width)] = all(greedy) if greedy else None
  return out


def _auto_line(auto: dict) -> str:
  return (f"{auto['speedup']:.2f}x, chose {auto['gamma_counts']}"
          + (' (the baseline throughout)' if auto['chose_baseline'] else '')
          + f", identical {auto['identical_outputs']}")


def _auto_summary(rows: list[dict]) -> dict:
  """Part d's verdict on gamma='auto': per row (batch size, step width) its speedup over
  the baseline, whether it ran the baseline throughout, and whether every row is at
  least AUTO_FLOOR of the baseline with the baseline's greedy outputs."""
  auto_rows = [row for row in rows if 'auto' in row]
  summary = [{'batch': row['batch'], 'decode_positions': row['decode_positions'],
              'speedup': row['auto']['speedup'],
              'chose_baseline': row['auto']['chose_baseline'],
              'gamma_counts': row['auto']['gamma_counts'],
              'identical_outputs': row['auto']['identical_outputs']} for row in auto_rows]
  return {'floor': AUTO_FLOOR, 'rows': summary,
          'never_slower': (all(row['auto']['speedup'] >= AUTO_FLOOR
                               and row['auto']['identical_outputs'] for row in auto_rows)
                           if auto_rows else None)}


def part_drafters(run: Run) -> dict:
  args = run.args
  names = ('small',) if args.tiny else ('small', 'base')
  models = _models(run, 'bfloat16', names)
  config = models.target_config.replace(decode_positions=args.decode_positions[-1])
  params = models.target_params
  out = {'pair': models.name, 'dtype': 'bfloat16', 'batch': 1, 'gamma': args.gamma,
         'decode_positions': config.decode_positions, 'drafters': {}, 'skipped': []}
  run.record['parts'][PART_NAMES['e']] = out
  int8 = Int8Drafter(config)
  drafters = {name: (T5Drafter(c), p) for name, (c, p) in models.drafts.items()}
  drafters['int8'] = (int8, int8.draft_params(params))
  # c: each drafter's proposal against the target's steps, interleaved.
  setup = run.setup(1, source_length=models.inputs.shape[1])
  calls = {('step', k): call for k, call in accelerator.step_calls(
      params, config, setup, [1, args.gamma + 1]).items()}
  for name, (drafter, drafter_params) in drafters.items():
    if name == 'int8':  # stand-alone: params of both, the target's encoder once per call
      drafter, drafter_params = (SharedEncoderDrafterWithTarget(drafter, config),
                                 {'draft': drafter_params, 'target': params})
    calls.update({(name, n): call for n, call in accelerator.proposal_calls(
        drafter, drafter_params, setup, args.gamma).items()})
  times, first = accelerator.time_calls(calls, args.repeats)
  step = accelerator.step_seconds(times, ('step', 1), setup)
  verify_cost = accelerator.ratio(times, ('step', args.gamma + 1), ('step', 1))
  out.update(step_ms=1e3 * step, verify_cost=verify_cost, first_calls_s=first)
  for name in drafters:
    proposal = accelerator.slope_seconds(times, (name,))
    out['drafters'][name] = {'proposal_ms': 1e3 * proposal,
                             'c': proposal / (args.gamma * step), 'runs': {}}
  # alpha and the speedup, end to end, each temperature's decoders interleaved.
  estimate = 0.0
  for temperature in TEMPERATURES:
    if not run.budget.allows(estimate):
      out['skipped'].append({'temperature': temperature, 'reason': 'over the part budget'})
      continue
    start = time.perf_counter()
    try:
      results, _, _ = accelerator.end_to_end(
          params, config, drafters, models.inputs, batch=1, temperature=temperature,
          gamma=args.gamma, max_decode_length=models.max_decode_length,
          repeats=args.repeats, seed=args.seed)
    except Exception as error:  # noqa: BLE001
      out['skipped'].append(dict(_error(error), temperature=temperature))
      continue
    estimate = time.perf_counter() - start
    for name, entry in out['drafters'].items():
      result = results[name]
      entry['runs'][temperature] = dict(
          alpha=result['alpha'], speedup=result['speedup'],
          tokens_per_target_call=result['tokens_per_target_call'],
          identical_outputs=result['identical_outputs'],
          predicted_speedup=accelerator.predicted_speedup(
              min(max(result['alpha'], 0.0), 1.0), args.gamma, entry['c'], verify_cost))
      print(f"e: {name} T={temperature}: c {entry['c']:.3f}, alpha {result['alpha']:.2f}, "
            f"speedup {result['speedup']:.2f}x (predicted "
            f"{entry['runs'][temperature]['predicted_speedup']:.2f}x)", flush=True)
    run.write()
  return out


# ---------------------------------------------------------------------------
# Part p: where the time goes.


def _profile_setup(run: Run) -> profile_lib.ProfileSetup:
  args = run.args
  return profile_lib.ProfileSetup(
      gamma=args.gamma, max_decode_length=args.loop_length,
      num_proposals=2 if args.tiny else 8, draft_loops=tuple(args.profile_loops),
      repeats=args.repeats)


def _profile_models(run: Run):
  """(target config, params, draft config, params) of part p: part b's pair."""
  args = run.args
  config, draft_config = run.config(args.loop_size), run.config('small')
  return (config, accelerator.random_params(config, args.seed), draft_config,
          accelerator.random_params(draft_config, args.seed + 2))


def profile_here(run: Run) -> dict:
  """Part p's measurements in this process, under its XLA flags."""
  config, params, draft_config, draft_params = _profile_models(run)
  result = profile_lib.profile_decode(
      params, config, T5Drafter(draft_config), draft_params, setup=run.setup(1),
      profile=_profile_setup(run), seed=run.args.seed, deadline=run.budget.allows)
  result['xla_flags'] = os.environ.get('XLA_FLAGS', '')
  return result


def _child_command(run: Run, path: str, seconds: float) -> list[str]:
  """This command again, profiling only (part p in this process's settings)."""
  args = run.args
  command = [sys.executable, '-m', 'jaxspec.launch.accelerator_bench', '--parts=p',
             f'--profile_child={path}', '--profile_variants=none',
             f"--profile_loops={','.join(args.profile_loops)}", f'--budget_s={seconds:.0f}',
             f'--gamma={args.gamma}', f'--repeats={args.repeats}', f'--seed={args.seed}',
             f'--loop_length={args.loop_length}', f'--cpu_matmul={args.cpu_matmul}',
             f'--output_dir={os.path.dirname(path)}']
  if args.tiny:
    return command + ['--tiny']
  return command + [f'--sizes={args.loop_size}', f'--loop_size={args.loop_size}']


def _refusal(stderr: str) -> str | None:
  """XLA's message where it refused a flag at start-up ('Unknown flag in XLA_FLAGS:
  ...', an illegal value), else None."""
  for line in stderr.splitlines():
    if re.search(r'(unknown|illegal|invalid).*flag|flag.*(unknown|illegal|invalid|parse)',
                 line, re.IGNORECASE):
      return line.strip()
  return None


def run_variant(run: Run, flags: str, seconds: float) -> dict:
  """Part p in a child process with `flags` added to XLA_FLAGS: its record, or
  {'refused': XLA's message}, {'failed': ...} or {'timed_out_s': ...}."""
  environment = dict(os.environ)
  environment['XLA_FLAGS'] = f"{environment.get('XLA_FLAGS', '')} {flags}".strip()
  with tempfile.TemporaryDirectory(prefix='jaxspec-profile-child-') as scratch:
    path = os.path.join(scratch, 'profile.json')
    try:
      finished = subprocess.run(_child_command(run, path, seconds), env=environment,
                                capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
      return {'timed_out_s': seconds}
    if finished.returncode == 0 and os.path.exists(path):
      with open(path) as f:
        return json.load(f)
  refused = _refusal(finished.stderr)
  if refused:
    return {'refused': refused}
  tail = ' | '.join(finished.stderr.strip().splitlines()[-3:])
  return {'failed': f'exit status {finished.returncode}: {tail}'}


def _variants(run: Run) -> dict[str, str]:
  variants = run.args.profile_variants
  if variants == 'auto':
    return dict(GPU_FLAG_VARIANTS) if run.record['device']['platform'] == 'gpu' else {}
  return variants


def part_profile(run: Run) -> dict:
  args = run.args
  out = {'target': config_name(run, args.loop_size), 'draft': config_name(run, 'small'),
         'dtype': 'bfloat16', 'batch': 1, 'gamma': args.gamma,
         'max_decode_length': args.loop_length,
         'draft_loop_auto': draft_loops.draft_loop_for(run.record['device']['platform']),
         'variants': {}}
  run.record['parts'][PART_NAMES['p']] = out
  start = time.perf_counter()
  out.update(profile_here(run))
  for form, entry in out['forms'].items():
    print(f"p: {form}: iteration {entry['iteration_ms']:.3f} ms, proposal "
          f"{entry['proposal_ms']:.3f} ms" + (
              f", {_fmt(entry['loop']['d2h_copies_per_iteration'], '.1f')} device-to-host "
              f"copies and {_fmt(entry['loop']['host_waits_per_iteration'], '.1f')} host waits "
              f"an iteration, idle {_pct(entry['loop']['idle_fraction'])}"
              if 'loop' in entry else ''), flush=True)
  run.write()
  # A child compiles what this process compiled, after its start-up.
  estimate = out.get('first_calls_s', 0.0) + CHILD_OVERHEAD_S
  for name, flags in _variants(run).items():
    if not run.budget.allows(estimate):
      out['variants'][name] = {'flags': flags, 'skipped': 'over the part budget'}
      continue
    # The rest of the part's time, or half as long again as expected where that is more.
    seconds = max(1.5 * estimate, run.budget.part_deadline - run.budget.clock())
    began = time.perf_counter()
    out['variants'][name] = dict(run_variant(run, flags, seconds), flags=flags,
                                 seconds=time.perf_counter() - began)
    print(f'p: variant {name}: ' + _variant_line(out['variants'][name]), flush=True)
    run.write()
  out['seconds'] = time.perf_counter() - start
  return out


def _variant_line(entry: dict) -> str:
  """A variant's outcome: its forms' times, or why it has none."""
  if entry.get('forms'):
    return ', '.join(f"{form} iteration {e['iteration_ms']:.3f} ms"
                     for form, e in entry['forms'].items())
  for outcome in ('refused', 'failed', 'timed_out_s', 'skipped'):
    if outcome in entry:
      return f'{outcome}: {entry[outcome]}'
  return str(entry)


def profile_child(args) -> dict:
  """--profile_child: part p here, written to the path the parent gave."""
  device = accelerator.device_description()
  run = Run(args=args, budget=accelerator.Budget(args.budget_s, {'p': 1.0}),
            record={'device': device, 'parts': {}}, json_path='', md_path='',
            peak=device['peak_bandwidth_bytes_per_s'])
  run.budget.begin('p', [])
  result = profile_here(run)
  inference.write_text_atomic(args.profile_child, json.dumps(_jsonable(result)) + '\n')
  return result


PART_FUNCTIONS = {'p': part_profile, 'a': part_step_costs, 'b': part_loop_overhead,
                  'c': part_table2, 'd': part_end_to_end, 'e': part_drafters}


# ---------------------------------------------------------------------------
# The record and its markdown.


def _fmt(value, spec: str = '.3f') -> str:
  if value is None:
    return '-'
  if isinstance(value, bool):
    return 'yes' if value else 'no'
  if isinstance(value, (int, float)):
    return format(value, spec)
  return str(value)


def _x(value) -> str:
  return '-' if value is None else f'{value:.2f}x'


def _pct(value) -> str:
  return '-' if value is None else f'{value:.0%}'


def _identical_by_width(part: dict) -> str:
  """Part d's greedy verdicts: one per decode_positions (a bare verdict in records made
  before the setting)."""
  verdicts = part.get('greedy_identical')
  if not isinstance(verdicts, dict):
    return _fmt(verdicts)
  return ', '.join(f"{_fmt(v)} (steps {int(w) or '-'})" for w, v in verdicts.items())


def _variant_lines(a: dict) -> list[str]:
  """Part a's A/B items: each variant's steps against the run's own (ratio > 1: slower)."""
  rows = []
  for size, batches in a['targets'].items():
    for batch, entry in batches.items():
      for name, variant in entry.get('variants', {}).items():
        rows.append((entry.get('config', size), batch, name, variant))
  for batch, draft in a['drafts']['small'].items():
    for name, variant in draft.get('variants', {}).items():
      rows.append((draft.get('config', 'small'), batch, name, variant))
  if not rows:
    return []
  lines = ['', f"Variants against the run's own steps (layout {a.get('layout', '-')}, "
           "jaxspec's einsum attention): ratio = variant / own, median over repetitions "
           '(> 1: the variant is slower).', '',
           '| model | batch | variant | step | ratio | verify step | ratio |', '|---' * 7 + '|']
  for model, batch, name, variant in rows:
    if 'error' in variant:
      lines.append(f"| {model} | {batch.split('_')[-1]} | {name} | {variant['error']} |")
      continue
    lines.append(f"| {model} | {batch.split('_')[-1]} | {name} | "
                 f"{_fmt(variant.get('step_ms'))} ms | {_fmt(variant.get('step_ratio'), '.2f')} | "
                 f"{_fmt(variant.get('verify_ms'))} | {_fmt(variant.get('verify_ratio'), '.2f')} |")
  return lines


def _auto_lines(d: dict) -> list[str]:
  """Part d's gamma='auto' rows and verdict."""
  summary = d.get('auto') or {}
  if not summary.get('rows'):
    return []
  lines = ['', f"gamma='auto' (choosing among 0 and {d.get('auto_gammas')}, calibrated on "
           f"the same inputs), greedy, {d['dtypes'][0]}: at least {summary['floor']:.2f}x "
           'of the baseline with its outputs in every row: '
           f"{_fmt(summary['never_slower'])}.", '',
           '| steps | batch | speedup | chose (gamma: batches) | baseline throughout | '
           'identical |', '|---' * 6 + '|']
  for row in summary['rows']:
    lines.append(f"| {row['decode_positions'] or '-'} | {row['batch']} | "
                 f"{_x(row['speedup'])} | {row['gamma_counts']} | "
                 f"{_fmt(row['chose_baseline'])} | {_fmt(row['identical_outputs'])} |")
  return lines


def _profile_rows(label: str, forms: dict) -> list[str]:
  rows = []
  for form, entry in forms.items():
    loop, draft = entry.get('loop', {}), entry.get('draft', {})
    rows.append(
        f"| {label} | {form} | {entry['iteration_ms']:.3f} ms | {entry['proposal_ms']:.3f} ms | "
        f"{entry['draft_token_ms']:.3f} ms | {_fmt(draft.get('kernels_per_draft_step'), '.1f')} | "
        f"{_fmt(loop.get('kernels_per_iteration'), '.0f')} | "
        f"{_fmt(loop.get('d2h_copies_per_iteration'), '.2f')} | "
        f"{_fmt(loop.get('host_waits_per_iteration'), '.2f')} | "
        f"{_fmt(loop.get('idle_ms_per_iteration'), '.3f')} ms | "
        f"{_pct(loop.get('idle_fraction'))} |")
  return rows


def _profile_markdown(p: dict | None) -> list[str]:
  if not p:
    return []
  if 'forms' not in p:
    return ['## p. Where the time goes', '', str(p), '']
  verify = p.get('verify', {})
  lines = ['## p. Where the time goes (jax.profiler traces)', '',
           f"{p['target']} target, {p['draft']} draft, {p['dtype']}, batch {p['batch']}, gamma "
           f"{p['gamma']}, {p['max_decode_length']} tokens; operations read from "
           f"{p.get('trace_source', '-')}; 'auto' draft loop here: {p['draft_loop_auto']}. "
           f"Verify step: {p['verify_step_ms']:.3f} ms, "
           f"{_fmt(verify.get('kernels_per_verify_step'), '.1f')} kernels. Per iteration: "
           'the loop less its prologue, over its iterations; idle: no device operation '
           'running within the program.', '',
           '| XLA flags | draft loop | iteration | proposal | per draft token | kernels per '
           'draft step | kernels per iteration | D2H copies per iteration | host waits per '
           'iteration | idle per iteration | idle |', '|---' * 11 + '|']
  lines += _profile_rows(p.get('xla_flags') or 'defaults', p['forms'])
  notes = []
  for name, variant in p.get('variants', {}).items():
    if 'forms' in variant:
      lines += _profile_rows(f"{name} (`{variant['flags']}`)", variant['forms'])
    else:
      notes.append(f"{name} (`{variant['flags']}`): {_variant_line(variant)}")
  if p.get('skipped'):
    notes.append(f"skipped: {p['skipped']}")
  lines += [''] + [f'- {note}' for note in notes] if notes else []
  return lines + [''] + _kernel_kind_lines(p)


def _kernel_kind_lines(p: dict) -> list[str]:
  """Where a draft step's and a verify step's kernels go, by kind (the default flags;
  the draft loop form 'auto' takes here)."""
  steps = [('draft step', p['forms'].get(p['draft_loop_auto'], {}).get('draft', {}),
            'draft_step'),
           ('verify step', p.get('verify', {}), 'verify_step')]
  lines = []
  for label, record, name in steps:
    kinds = record.get('kernel_kinds')
    if not kinds:
      continue
    lines += [f'Kernels of a {label} by kind, the longest first:', '',
              f'| kind | kernels per {label} | us per {label} |', '|---|---|---|']
    lines += [f"| `{k['kind']}` | {_fmt(k[f'kernels_per_{name}'], '.1f')} | "
              f"{_fmt(k[f'us_per_{name}'], '.1f')} |" for k in kinds]
    lines.append('')
  return lines


def markdown(record: dict) -> str:
  device = record['device']
  peak = device.get('peak_bandwidth_bytes_per_s')
  memory = device.get('memory_bytes')
  lines = [f"# Accelerator bench: {device['device_kind']} ({device['platform']}, "
           f"{device['count']} device(s))", '',
           f"{record['date']}, commit {record.get('commit') or 'unknown'}, jax "
           f"{record['versions']['jax']} / jaxlib {record['versions']['jaxlib']}; memory "
           f"{'-' if memory is None else f'{memory / 2**30:.0f} GiB'}; peak bandwidth "
           f"{'unknown' if peak is None else f'{peak / 1e12:.2f} TB/s'}; "
           f"matmul: {record.get('matmul', '-')}. `{record['command']}`", '',
           f"Parts done: {', '.join(record['parts_done']) or 'none'}"
           + (f"; skipped: {record['parts_skipped']}" if record['parts_skipped'] else ''), '']
  parts = record['parts']
  lines += _profile_markdown(parts.get(PART_NAMES['p']))
  a = parts.get(PART_NAMES['a'])
  if a:
    positions = [k for k in a['positions'] if k > 1]
    lines += ['## a. Step costs (bfloat16, random weights)', '',
              'One cached decode step over k positions; V(k) = step(k) / step(1), median '
              'over interleaved repetitions; bandwidth = bytes a step reads (decoder '
              'weights and cache) / time / peak; c = the draft\'s step / the target\'s '
              f"one-position step (int8: a proposal of gamma = {a['gamma']} / gamma steps).",
              '', '| target | batch | params | step | bandwidth | '
              + ' | '.join(f'V({k})' for k in positions)
              + ' | int8 c | int8 bandwidth | small c | head c |',
              '|---' * (9 + len(positions)) + '|']
    for size, batches in a['targets'].items():
      for batch, entry in batches.items():
        if 'steps' not in entry:
          lines.append(f"| {size} | {batch} | {entry.get('error', '-')} |")
          continue
        steps = entry['steps']
        lines.append(
            f"| {entry['config']} | {batch.split('_')[-1]} | "
            f"{entry['parameters'] / 1e6:.0f}M | {steps[1]['ms']:.3f} ms | "
            f"{_pct(steps[1]['bandwidth_fraction'])} | "
            + ' | '.join(_fmt(steps[k]['V'], '.2f') if k in steps else '-' for k in positions)
            + f" | {_fmt(entry['int8_draft']['c'])} | "
            f"{_pct(entry['int8_draft']['bandwidth_fraction'])} | "
            f"{_fmt(entry.get('small_draft', {}).get('c'))} | "
            f"{_fmt(entry.get('feature_head', {}).get('c'))} |")
    for batch, draft in a['drafts']['small'].items():
      if 'step_ms' in draft:
        lines.append('')
        lines.append(f"Small draft ({draft['config']}), {batch.replace('_', ' ')}: step "
                     f"{draft['step_ms']:.3f} ms ({_pct(draft['bandwidth_fraction'])} of "
                     f"peak bandwidth), proposal of {a['gamma']} tokens "
                     f"{draft['proposal_ms']:.3f} ms.")
    lines += _variant_lines(a)
    if a['skipped']:
      lines += ['', f"Skipped: {a['skipped']}"]
    lines.append('')
  b = parts.get(PART_NAMES['b'])
  if b:
    lines += ['## b. The speculative loop against its parts', '']
    if 'iteration_ms' in b:
      lines += [f"{b['target']} target, {b['draft']} draft, gamma {b['gamma']}, batch "
                f"{b['batch']}, {b['iterations']} iterations: per iteration "
                f"{b['iteration_ms']:.3f} ms = proposal {b['proposal_ms']:.3f} ms + verify "
                f"step {b['verify_ms']:.3f} ms + loop overhead {b['overhead_ms']:.3f} ms "
                f"({_pct(b['overhead_fraction'])} of the iteration).", '']
    else:
      lines += [str(b), '']
  c = parts.get(PART_NAMES['c'])
  if c:
    lines += ['## c. Table 2 predicted from the measured costs', '']
    if 'rows' in c:
      lines += [f"Target {c['target']}; {c['note']}. Predicted speedup = E[tokens per "
                'iteration](alpha, gamma) / (gamma c + V(gamma + 1)) at the best measured '
                'gamma; Theorem 3.8 takes V = 1. Best chain and best tree: '
                'jaxspec.measure.tree_sizing over V(k) interpolated between the measured k '
                '(num_drafts x gamma, the verify step over 1 + num_drafts x gamma positions; '
                'the j-th branch right with probability alpha (1 - alpha)^(j - 1); the '
                'branches drafted as one batch, at the draft\'s step at that batch where '
                'part a measured it).', '',
                '| task | draft | T | alpha | c | best gamma | predicted | at paper gamma '
                '| Theorem 3.8 | best chain | best tree | paper gamma | paper c | '
                'paper speedup |', '|---' * 14 + '|']
      for row in c['rows']:
        lines.append(
            f"| {row['task']} | {row['draft']} | {row['temperature']} | {row['alpha']} | "
            f"{_fmt(row['c'])} | {_fmt(row['best_gamma'], 'd')} | "
            f"{_x(row['predicted_speedup'])} | {_x(row['predicted_at_paper_gamma'])} | "
            f"{_x(row['theorem_3_8_speedup'])} | {_shape(row.get('best_chain'))} | "
            f"{_shape(row.get('best_tree'))} | {row['paper_gamma'] or '-'} | "
            f"{row['paper_c'] or '-'} | "
            f"{_x(row['paper_speedup']) if row['paper_speedup'] else '- (alpha measured here)'} |")
    else:
      lines.append(str(c))
    lines.append('')
  d = parts.get(PART_NAMES['d'])
  if d:
    lines += ['## d. End to end', '',
              f"{d.get('pair', '-')}, small draft, gamma {d['gamma']}, {d['examples']} "
              f"inputs, max_decode_length {d.get('max_decode_length', '-')}; greedy outputs "
              f"identical to the baseline's in every dtype: {_identical_by_width(d)}"
              + (f"; greedy rows equal across bfloat16 and float32: "
                 f"{d['greedy_rows_equal_across_dtypes']}/{d['examples']}"
                 if 'greedy_rows_equal_across_dtypes' in d else '') + '. Steps: the '
              "target's decode_positions (- : each step as wide as its tokens).", '',
              '| dtype | steps | batch | T | baseline tokens/s | speculative tokens/s | '
              'speedup | alpha | tokens per target call | identical |', '|---' * 10 + '|']
    for row in d['rows']:
      steps = row.get('decode_positions') or '-'
      if 'speculative' not in row:
        lines.append(f"| {row['dtype']} | {steps} | {row['batch']} | {row['temperature']} | "
                     f"{row.get('error', '-')} |")
        continue
      spec = row['speculative']
      lines.append(
          f"| {row['dtype']} | {steps} | {row['batch']} | {row['temperature']} | "
          f"{row['baseline']['tokens_per_s']:.0f} | {spec['tokens_per_s']:.0f} | "
          f"{spec['speedup']:.2f}x | {spec['alpha']:.3f} | "
          f"{spec['tokens_per_target_call']:.2f} | {_fmt(spec['identical_outputs'])} |")
    lines += _auto_lines(d)
    if d.get('skipped'):
      lines += ['', f"Skipped: {d['skipped']}"]
    lines.append('')
  e = parts.get(PART_NAMES['e'])
  if e:
    lines += ['## e. Drafters on this device', '',
              f"{e['pair']}, bfloat16, batch 1, gamma {e['gamma']}, target steps "
              f"{e.get('decode_positions') or 'as wide as their tokens'}; target step "
              f"{_fmt(e.get('step_ms'))} ms, V(gamma + 1) = {_fmt(e.get('verify_cost'), '.2f')}; "
              'c = proposal / (gamma x target step).', '',
              '| drafter | proposal | c | T | alpha | speedup | predicted | identical |',
              '|---' * 8 + '|']
    for name, entry in e['drafters'].items():
      for temperature, result in entry['runs'].items():
        lines.append(f"| {name} | {entry['proposal_ms']:.3f} ms | {entry['c']:.3f} | "
                     f"{temperature} | {result['alpha']:.3f} | {result['speedup']:.2f}x | "
                     f"{result['predicted_speedup']:.2f}x | "
                     f"{_fmt(result['identical_outputs'])} |")
      if not entry['runs']:
        lines.append(f"| {name} | {entry['proposal_ms']:.3f} ms | {entry['c']:.3f} | - | "
                     '- | - | - | - |')
    if e.get('skipped'):
      lines += ['', f"Skipped: {e['skipped']}"]
    lines.append('')
  for name, part in parts.items():
    if isinstance(part, dict) and 'error' in part:
      lines += [f'## {name}: failed', '', part['error'], '']
  return '\n'.join(lines)


def main(argv=None):
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  if args.profile_child:
    return profile_child(args)
  device = accelerator.device_description()
  slug = accelerator.device_slug(device['device_kind']) + ('-tiny' if args.tiny else '')
  command = 'jaxspec-accelerator-bench ' + ' '.join(
      shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
  record = {
      'kind': 'accelerator_bench', 'commit': machine.git_commit(),
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'device': device, 'versions': accelerator.versions(), 'command': command.strip(),
      'matmul': cpu_matmul_lib.kernel_status(args.cpu_matmul),
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'settings': {k: v for k, v in vars(args).items()},
      'parts_done': [], 'parts_skipped': {}, 'parts': {}}
  record['provenance'] = {
      'commit': (record['commit'] or '')[:7], 'date': record['date'][:10],
      'machine': f"{device['device_kind']} x{device['count']} ({device['platform']}), "
                 f"host {device['host_cpu']}, {device['host_cores']} cores",
      'command': record['command']}
  run = Run(args=args, budget=accelerator.Budget(args.budget_s, SHARES), record=record,
            json_path=os.path.join(args.output_dir, f'{slug}.json'),
            md_path=os.path.join(args.output_dir, f'{slug}.md'),
            peak=device['peak_bandwidth_bytes_per_s'])
  print(f"accelerator bench on {device['device_kind']} ({device['platform']}); parts "
        f"{','.join(args.parts)}; budget {args.budget_s:.0f} s; writing {run.json_path}",
        flush=True)
  for index, part in enumerate(args.parts):
    seconds = run.budget.begin(part, args.parts[index + 1:])
    if run.budget.remaining() <= 0:
      record['parts_skipped'][part] = 'the total budget is spent'
      run.write()
      continue
    start = time.perf_counter()
    try:
      result = PART_FUNCTIONS[part](run)
    except Exception as error:  # noqa: BLE001  (recorded; the later parts still run)
      result = _error(error)
    result['part_seconds'] = time.perf_counter() - start
    result['part_budget_s'] = seconds
    record['parts'][PART_NAMES[part]] = result
    record['parts_done'].append(part)
    run.write()
    print(f"part {part} ({PART_NAMES[part]}) done in {result['part_seconds']:.1f} s "
          f"(budget {seconds:.0f} s)", flush=True)
  print(markdown(record))
  print(f'wrote {run.json_path} and {run.md_path}')
  return record


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

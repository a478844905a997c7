"""jaxspec against Hugging Face transformers on the same weights, side by side.

  python scripts/bench_peers.py                        # the shipped local EnDe pair
  python scripts/bench_peers.py --num_examples=20 --repeats=5 --gamma=4

Exports the local target and drafts (T5X checkpoints + gin model files) to Hugging
Face format in a temporary directory, loads them with transformers' PyTorch T5, and
decodes the first N examples of the EnDe test split, batch 1, greedy, with
  hf_greedy          transformers `generate` on the target alone,
  hf_assisted        `generate(..., assistant_model=draft)` with transformers' default
                     assistant settings,
  hf_assisted_gamma  the same with a constant `num_assistant_tokens` = gamma and the
                     confidence stop off, i.e. what jaxspec does,
  jaxspec_baseline   `jaxspec.decoding.baseline.generate`,
  jaxspec_speculative `speculative_generate` with a `T5Drafter`, gamma drafts.
Each decoder runs twice on the first example before the clock starts (its first call
holds the jit compile, reported apart); then every repeat decodes all examples,
interleaved example by example, and a decoder's time is the median over repeats of
its total. Tokens are generated tokens up to and including EOS. Greedy outputs are
compared token for token with hf_greedy; at each difference both frameworks' target
logits at the first differing position are compared. Writes <output_dir>/peers.json
and peers.md and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable

# On a shared CPU, OpenMP threads that spin at barriers while another process holds a
# core made transformers' greedy generate 10x slower with 2 threads here; waiting
# passively avoids that. It must be set before torch loads OpenMP.
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

import gin
import jax
import numpy as np
import torch
import transformers

from jaxspec.launch import command, gin_flags
import jaxspec.configurables  # noqa: F401  (registers T5Config with gin)
from jaxspec import inference, machine
from jaxspec.checkpoints.hf import save_hf_checkpoint
from jaxspec.config import EOS_ID, PAD_ID, T5Config
from jaxspec.data import corpora
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import T5
from jaxspec.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)
DEFAULT_TARGET = 'gin/models/local_target.gin:checkpoints/ende/target'
DEFAULT_DRAFTS = ('draft_small=gin/models/local_draft_small.gin:checkpoints/ende/draft_small',
                  'draft_base=gin/models/local_draft_base.gin:checkpoints/ende/draft_base')


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--target', default=DEFAULT_TARGET, help='GIN_FILE:T5X_CHECKPOINT')
  parser.add_argument('--draft', action='append', default=None,
                      help='NAME=GIN_FILE:T5X_CHECKPOINT (repeatable)')
  parser.add_argument('--num_examples', type=int, default=50)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--gamma', type=int, default=3)
  parser.add_argument('--max_new_tokens', type=int, default=64)
  parser.add_argument('--input_length', type=int, default=64)
  parser.add_argument('--corpus', default='ende')
  parser.add_argument('--split', default='test')
  parser.add_argument('--output_dir', default='results')
  parser.add_argument('--torch_threads', type=int, default=len(os.sched_getaffinity(0)),
                      help='torch.set_num_threads (default: the cores this process may use)')
  command.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  args.draft = args.draft or list(DEFAULT_DRAFTS)
  return args


# ---------------------------------------------------------------------------
# Models: gin config + T5X checkpoint -> jaxspec variables and a transformers model.


def _repo_path(path: str) -> str:
  """A gin file of the checkout (or the wheel's copy) unless absolute."""
  return path if os.path.isabs(path) else os.path.join(gin_flags.GIN_ROOT, path)


def model_config_from_gin(gin_file: str) -> T5Config:
  """The T5Config bound to the `MODEL` macro of a model gin file (gin/models/*.gin)."""
  gin.clear_config()
  try:
    gin.parse_config_file(_repo_path(gin_file))
    return gin.query_parameter('%MODEL').scoped_configurable_fn()
  finally:
    gin.clear_config()


def load_jaxspec_model(spec: str) -> tuple[T5Config, dict]:
  """'GIN_FILE:CHECKPOINT' -> (config, variables {'params': ...}) in float32."""
  gin_file, _, checkpoint = spec.partition(':')
  config = model_config_from_gin(gin_file)
  return config, inference.load_model_params(checkpoint, config)


def load_transformers(directory: str, **assistant_settings):
  """transformers' T5ForConditionalGeneration from an exported directory, in eval mode,
  with `assistant_settings` in its generation config (read when it is a draft)."""
  model = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
  for name, value in assistant_settings.items():
    setattr(model.generation_config, name, value)
  return model


def effective_assistant_settings(draft_model) -> dict:
  """What transformers' AssistedCandidateGenerator will use: the draft's generation
  config with transformers' global defaults filling the unset fields."""
  config = copy.deepcopy(draft_model.generation_config)
  defaults = getattr(config, '_get_default_generation_params', dict)()  # transformers >= 4.56
  config.update(**defaults, defaults_only=True)
  names = ('num_assistant_tokens', 'num_assistant_tokens_schedule',
           'assistant_confidence_threshold')
  settings = {name: getattr(config, name) for name in names}
  # Without scikit-learn transformers keeps the confidence threshold fixed.
  settings['threshold_adapted'] = bool(transformers.utils.is_sklearn_available())
  return settings


# ---------------------------------------------------------------------------
# Decoders: each maps one encoded example [input_length] to its tokens up to EOS.


def hf_decoder(model, max_new_tokens: int, assistant=None) -> Callable:
  def decode(row: np.ndarray) -> list[int]:
    input_ids = torch.tensor(row[row != PAD_ID][None])  # batch 1 needs no padding
    with torch.inference_mode():
      output = model.generate(
          input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
          assistant_model=assistant, do_sample=False, num_beams=1,
          max_new_tokens=max_new_tokens, min_length=0, decoder_start_token_id=PAD_ID,
          eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return inference.trim_at_eos(output[0, 1:].numpy(), EOS_ID)  # start token dropped
  return decode


def jaxspec_baseline_decoder(config, variables, max_new_tokens: int) -> Callable:
  def decode(row: np.ndarray) -> list[int]:
    output = generate(variables, row[None], config=config, max_decode_length=max_new_tokens,
                      sampling=GREEDY)
    return inference.trim_at_eos(np.asarray(output.tokens[0]), EOS_ID)
  return decode


def jaxspec_speculative_decoder(target, draft, gamma: int, max_new_tokens: int,
                                target_calls: list) -> Callable:
  """Also appends each call's target decode steps to `target_calls`."""
  (target_config, target_variables), (draft_config, draft_variables) = target, draft
  drafter, spec = T5Drafter(draft_config), SpeculativeConfig(gamma=gamma)

  def decode(row: np.ndarray) -> list[int]:
    result = speculative_generate(
        target_variables, draft_variables, row[None], jax.random.PRNGKey(0),
        target_config=target_config, drafter=drafter, spec=spec,
        max_decode_length=max_new_tokens, sampling=GREEDY)
    target_calls.append(int(result.stats.row_target_calls[0]))
    return inference.trim_at_eos(np.asarray(result.output.tokens[0]), EOS_ID)
  return decode


# ---------------------------------------------------------------------------
# Timing and comparison.


def warm_up(decoders: dict[str, Callable], row: np.ndarray) -> dict[str, dict]:
  """Two calls per decoder on one example; the first holds jit compilation."""
  seconds = {}
  for name, decode in decoders.items():
    first = _timed(decode, row)[1]
    warm = _timed(decode, row)[1]
    seconds[name] = {'first_call_seconds': first, 'warm_call_seconds': warm,
                     'compile_seconds': max(first - warm, 0.0)}
  return seconds


def _timed(decode: Callable, row: np.ndarray) -> tuple[list[int], float]:
  start = time.perf_counter()
  tokens = decode(row)
  return tokens, time.perf_counter() - start


def time_side_by_side(decoders: dict[str, Callable], rows: np.ndarray, repeats: int):
  """(tokens per decoder per example from the first repeat, total seconds per repeat)."""
  outputs = {name: [] for name in decoders}
  totals = {name: [0.0] * repeats for name in decoders}
  for repeat in range(repeats):
    start = time.perf_counter()
    for row in rows:
      for name, decode in decoders.items():
        tokens, seconds = _timed(decode, row)
        totals[name][repeat] += seconds
        if repeat == 0:
          outputs[name].append(tokens)
    print(f'repeat {repeat + 1}/{repeats}: {time.perf_counter() - start:.0f} s',
          file=sys.stderr, flush=True)
  return outputs, totals


def first_difference(tokens: list[int], reference: list[int]) -> int:
  """The first position where two token lists differ (they differ somewhere)."""
  common = min(len(tokens), len(reference))
  return next((i for i in range(common) if tokens[i] != reference[i]), common)


def logits_at(row: np.ndarray, prefix: list[int], target, hf_target) -> dict[str, np.ndarray]:
  """Both frameworks' target logits [v] for the token after `prefix`, teacher forced."""
  config, variables = target
  decoder_inputs = np.asarray([[PAD_ID] + prefix], np.int32)
  ours = T5(config).apply(variables, row[None], decoder_inputs)[0, -1]
  input_ids = torch.tensor(row[row != PAD_ID][None])
  with torch.inference_mode():
    theirs = hf_target(input_ids=input_ids, decoder_input_ids=torch.tensor(decoder_inputs)).logits
  return {'jaxspec': np.asarray(ours, np.float64), 'transformers': theirs[0, -1].double().numpy()}


def diagnose(index: int, row: np.ndarray, tokens: list[int], reference: list[int],
             target, hf_target) -> dict:
  """Where `tokens` leaves `reference` (hf_greedy), and how close the target's call was."""
  position = first_difference(tokens, reference)
  chosen = tokens[position] if position < len(tokens) else None
  expected = reference[position] if position < len(reference) else None
  report = {'example': index, 'position': position, 'token': chosen,
            'hf_greedy_token': expected}
  if chosen is None or expected is None:
    return report  # One ended (max length) where the other went on.
  logits = logits_at(row, reference[:position], target, hf_target)
  for framework, values in logits.items():
    report[f'{framework}_argmax'] = int(np.argmax(values))
    report[f'{framework}_logit_gap'] = float(values[expected] - values[chosen])
  report['max_abs_logit_difference'] = float(
      np.max(np.abs(logits['jaxspec'] - logits['transformers'])))
  return report


# ---------------------------------------------------------------------------
# Report.


def machine_description() -> dict:
  return {'cpu': machine.cpu_model(), 'cores': len(os.sched_getaffinity(0)), 'cpu_count': os.cpu_count(),
          'load_average_1m_at_start': os.getloadavg()[0],
          'torch_threads': torch.get_num_threads(),
          'omp_wait_policy': os.environ.get('OMP_WAIT_POLICY'), 'jax_device': jax.devices()[0].device_kind,
          'jax': jax.__version__, 'torch': torch.__version__,
          'transformers': transformers.__version__, 'python': platform.python_version()}


def decoder_rows(outputs, totals, warm, target_calls) -> list[dict]:
  rows = []
  for name in outputs:
    tokens = sum(len(t) for t in outputs[name])
    seconds = statistics.median(totals[name])
    identical = sum(a == b for a, b in zip(outputs[name], outputs['hf_greedy']))
    row = {'decoder': name, 'tokens': tokens, 'median_seconds': seconds,
           'tokens_per_second': tokens / max(seconds, 1e-9), 'seconds_per_repeat': totals[name],
           'identical_to_hf_greedy': identical, **warm[name]}
    if name in target_calls:
      row['tokens_per_target_call'] = tokens / max(sum(target_calls[name]), 1)
      row['identical_to_jaxspec_baseline'] = sum(
          a == b for a, b in zip(outputs[name], outputs['jaxspec_baseline']))
    rows.append(row)
  return rows


def ratios(rows: list[dict], draft_names: list[str]) -> dict[str, float]:
  """jaxspec over its transformers peer, tokens/s against tokens/s."""
  speed = {row['decoder']: row['tokens_per_second'] for row in rows}
  pairs = {'jaxspec_baseline / hf_greedy': ('jaxspec_baseline', 'hf_greedy')}
  for draft in draft_names:
    ours = f'jaxspec_speculative[{draft}]'
    pairs[f'{ours} / hf_assisted[{draft}]'] = (ours, f'hf_assisted[{draft}]')
    pairs[f'{ours} / hf_assisted_gamma[{draft}]'] = (ours, f'hf_assisted_gamma[{draft}]')
  return {label: speed[ours] / speed[theirs] for label, (ours, theirs) in pairs.items()}


def markdown(results: dict) -> str:
  machine, settings = results['machine'], results['settings']
  lines = [
      f"Machine: {machine['cpu']}, {machine['cores']} cores (load average "
      f"{machine['load_average_1m_at_start']:.2f} at start, "
      f"{machine['load_average_1m_at_end']:.2f} at end); jax {machine['jax']}, "
      f"torch {machine['torch']} ({machine['torch_threads']} threads, OMP_WAIT_POLICY "
      f"{machine['omp_wait_policy']}), "
      f"transformers {machine['transformers']}.",
      f"{settings['num_examples']} {settings['corpus']} {settings['split']} examples, batch 1, "
      f"greedy, input length {settings['input_length']}, max new tokens "
      f"{settings['max_new_tokens']}, gamma {settings['gamma']}, median of "
      f"{settings['repeats']} repeats.",
      '',
      '| decoder | tokens | median seconds | tokens/s | identical to hf_greedy '
      '| identical to jaxspec_baseline | tokens per target call | compile seconds |',
      '|---|---|---|---|---|---|---|---|']
  count = settings['num_examples']
  for row in results['decoders']:
    per_call = row.get('tokens_per_target_call')
    same_as_baseline = row.get('identical_to_jaxspec_baseline')
    lines.append(
        f"| {row['decoder']} | {row['tokens']} | {row['median_seconds']:.2f} "
        f"| {row['tokens_per_second']:.1f} | {row['identical_to_hf_greedy']} / {count} "
        f"| {'' if same_as_baseline is None else f'{same_as_baseline} / {count}'} "
        f"| {'' if per_call is None else f'{per_call:.2f}'} "
        f"| {row['compile_seconds']:.2f} |")
  lines += ['', '| ratio (tokens/s) | value |', '|---|---|']
  lines += [f'| {label} | {value:.2f}x |' for label, value in results['ratios'].items()]
  lines += ['', 'transformers assistant settings: ' + '; '.join(
      f'{name}: {value}' for name, value in results['assistant_settings'].items())]
  return '\n'.join(lines) + '\n'


# ---------------------------------------------------------------------------


def encoded_examples(args) -> np.ndarray:
  vocab = corpora.Vocabulary()
  examples = corpora.load_split(args.corpus, args.split)[:args.num_examples]
  return inference.pad_rows(
      [corpora.encode_example(e, args.corpus, vocab, args.input_length, args.max_new_tokens)[0]
       for e in examples], args.input_length)


def build_decoders(args, target, drafts, hf_dir: str, target_calls: dict):
  """Every decoder by name, transformers' assistant settings per assisted decoder, and
  the transformers target."""
  directories = {name: save_hf_checkpoint(model[1], model[0], os.path.join(hf_dir, name))
                 for name, model in {'target': target, **drafts}.items()}
  hf_target = load_transformers(directories['target'])
  decoders = {'hf_greedy': hf_decoder(hf_target, args.max_new_tokens),
              'jaxspec_baseline': jaxspec_baseline_decoder(*target, args.max_new_tokens)}
  settings = {}
  for name, draft in drafts.items():
    assistants = {
        f'hf_assisted[{name}]': load_transformers(directories[name]),
        f'hf_assisted_gamma[{name}]': load_transformers(
            directories[name], num_assistant_tokens=args.gamma,
            num_assistant_tokens_schedule='constant', assistant_confidence_threshold=0.0)}
    for decoder_name, assistant in assistants.items():
      decoders[decoder_name] = hf_decoder(hf_target, args.max_new_tokens, assistant)
      settings[decoder_name] = effective_assistant_settings(assistant)
    calls = target_calls.setdefault(f'jaxspec_speculative[{name}]', [])
    decoders[f'jaxspec_speculative[{name}]'] = jaxspec_speculative_decoder(
        target, draft, args.gamma, args.max_new_tokens, calls)
  return decoders, settings, hf_target


def compare_peers(args, target, drafts: dict, rows: np.ndarray, hf_dir: str) -> dict:
  """Runs every decoder side by side; returns the results dict (see the module doc)."""
  machine = machine_description()
  target_calls = {}
  decoders, assistant_settings, hf_target = build_decoders(args, target, drafts, hf_dir,
                                                           target_calls)
  warm = warm_up(decoders, rows[0])
  for calls in target_calls.values():
    calls.clear()
  outputs, totals = time_side_by_side(decoders, rows, args.repeats)
  for calls in target_calls.values():  # Keep the first repeat's counts.
    del calls[len(rows):]
  machine['load_average_1m_at_end'] = os.getloadavg()[0]
  reference = outputs['hf_greedy']
  differences = {name: [diagnose(i, rows[i], tokens[i], reference[i], target, hf_target)
                        for i in range(len(rows)) if tokens[i] != reference[i]]
                 for name, tokens in outputs.items() if name != 'hf_greedy'}
  table = decoder_rows(outputs, totals, warm, target_calls)
  return {'machine': machine, 'settings': dict(vars(args)),
          'assistant_settings': assistant_settings, 'decoders': table,
          'ratios': ratios(table, list(drafts)), 'differences': differences,
          'outputs': outputs}


def main(argv: list[str] | None = None) -> dict:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  torch.set_num_threads(args.torch_threads)
  target = load_jaxspec_model(args.target)
  drafts = {}
  for draft in args.draft:
    name, _, spec = draft.partition('=')
    drafts[name] = load_jaxspec_model(spec)
  rows = encoded_examples(args)
  args.num_examples = len(rows)
  with tempfile.TemporaryDirectory() as hf_dir:
    results = compare_peers(args, target, drafts, rows, hf_dir)
  os.makedirs(args.output_dir, exist_ok=True)
  with open(os.path.join(args.output_dir, 'peers.json'), 'w') as f:
    json.dump(results, f, indent=2)
  table = markdown(results)
  with open(os.path.join(args.output_dir, 'peers.md'), 'w') as f:
    f.write(table)
  print(table)
  return results


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

"""What speculative decoding costs on the device JAX sees (jaxspec-accelerator-bench).

The measurements behind jaxspec/launch/accelerator_bench.py, as functions the launcher
calls part by part; nothing here parses flags or writes files. Built from the step-cost
harness (jaxspec.measure.step_costs: decode steps in a fori_loop, calls interleaved
within each repetition) and the proposal timing of jaxspec.measure.benchmark (the
difference between two loop lengths, so a drafter's setup cancels out).

  device_description()            device kind, platform, count, memory, peak bandwidth
  random_params(config, seed)     random variables of any size, filled on the device
  random_int8_draft_params(...)   an int8 draft's params of the shapes Int8Drafter makes,
                                  random (no host quantization of a multi-GB decoder)
  decode_step_bytes(...)          the bytes one cached decode step must read
  step_calls / proposal_calls     timed calls: target steps over k positions, proposals
  time_calls(calls, repeats)      first-call (compile) seconds, then interleaved repeats
  step_seconds / ratio / slope_seconds
                                  a step's seconds, V(k), and a loop iteration's seconds
                                  from two loop lengths
  loop_overhead(...)              the speculative while loop per iteration against its
                                  proposal and verify step timed apart
  end_to_end(...)                 baseline against speculative decoding (fixed gammas and
                                  gamma='auto') over the same inputs: tokens/s, speedup,
                                  identical greedy outputs, alpha, what 'auto' chose
  table2_predictions(...)         the paper's Table 2 predicted from measured c and V(k),
                                  with the best chain and the best token tree
                                  (jaxspec.measure.tree_sizing)

Shape letters: b batch, s source length, k positions of a decode step, v vocabulary.
"""

from __future__ import annotations

import functools
import os
import re
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import machine
from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding import auto_gamma, speculative
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.measure import analysis, benchmark, step_costs, tree_sizing
from jaxspec.model import abstract_params
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model.quantization import int8_decoder
from jaxspec.sampling import SamplingConfig

# ---------------------------------------------------------------------------
# The device.

# Peak memory bandwidth (bytes/s) by device_kind, most specific pattern first (matched
# case-insensitively against jax.devices()[0].device_kind). Vendors' data sheets.
PEAK_BANDWIDTH: tuple[tuple[str, float], ...] = (
    (r'h100.*(pcie)', 2.0e12),
    (r'h100.*nvl', 3.9e12),
    (r'h100', 3.35e12),  # SXM (HBM3), e.g. 'NVIDIA H100 80GB HBM3'
    (r'gh200', 4.0e12),
    (r'h200', 4.8e12),
    (r'a100.*80gb', 2.0e12),
    (r'a100', 1.555e12),  # 40 GB
    (r'l40s', 8.64e11),
    (r'a10g', 6.0e11),
    (r'l4\b', 3.0e11),
    (r'v100', 9.0e11),
    (r'tpu v4', 1.2e12),
    (r'tpu v5 lite|tpu v5e', 8.19e11),
    (r'tpu v5p|tpu v5$', 2.765e12),
    (r'tpu v6 lite|tpu v6e', 1.64e12),
)


def peak_bandwidth(device_kind: str) -> float | None:
  """Peak memory bandwidth in bytes/s of a device kind; None where not in the table."""
  kind = device_kind.lower()
  for pattern, bandwidth in PEAK_BANDWIDTH:
    if re.search(pattern, kind):
      return bandwidth
  return None


def device_slug(device_kind: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (a file name)."""
  return re.sub(r'[^a-z0-9]+', '-', device_kind.lower()).strip('-') or 'device'


def device_description() -> dict:
  """The first device JAX sees: kind, platform, count, memory and peak bandwidth."""
  device = jax.devices()[0]
  memory = None
  try:
    stats = device.memory_stats() or {}
    memory = stats.get('bytes_limit')
  except Exception:  # noqa: BLE001  (not every platform reports memory)
    pass
  return {'device_kind': device.device_kind, 'platform': device.platform,
          'count': jax.device_count(), 'memory_bytes': memory,
          'peak_bandwidth_bytes_per_s': peak_bandwidth(device.device_kind),
          'host_cpu': machine.cpu_model(), 'host_cores': os.cpu_count()}


def versions() -> dict:
  import jaxlib  # pylint: disable=import-outside-toplevel
  return {'jax': jax.__version__, 'jaxlib': jaxlib.__version__}


# ---------------------------------------------------------------------------
# Random models of any size, on the device.


def _leaf_std(name: str, shape: tuple[int, ...]) -> float | None:
  """The spread of a random leaf of T5X's layout: None for norm scales (ones)."""
  if len(shape) < 2:
    return None
  if name == 'kernel':  # [in, out]
    return 1.0 / float(np.sqrt(shape[0]))
  if name == 'embedding':
    return 1.0
  return 0.1  # relative position biases


@functools.partial(jax.jit, static_argnames=('shape', 'dtype', 'std'))
def _random_leaf(key, *, shape, dtype, std):
  if std is None:
    return jnp.ones(shape, dtype)
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.lru_cache(maxsize=16)
def _abstract_params(config: T5Config):
  return abstract_params(config)['params']


def random_params(config: T5Config, seed: int = 0, layout: str | None = None) -> dict:
  """{'params': ...} of `config`, random (unit-scale activations), in config.param_dtype,
  made leaf by leaf on the default device from the abstract shapes (no forward pass, no
  host copy: an 11B model fills in about a second), in `layout` (default: the one that
  decodes fastest on this platform, jaxspec.model.cpu.layout.decode_layout)."""
  shapes = _abstract_params(config)  # traced once per config (seconds for XXL)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  key = jax.random.PRNGKey(seed)
  leaves = []
  for index, (path, leaf) in enumerate(flat):
    name = getattr(path[-1], 'key', str(path[-1]))
    leaves.append(_random_leaf(jax.random.fold_in(key, index), shape=tuple(leaf.shape),
                               dtype=jnp.dtype(config.param_dtype),
                               std=_leaf_std(name, tuple(leaf.shape))))
  params = {'params': jax.tree_util.tree_unflatten(treedef, leaves)}
  return kernel_layout.to_layout(params, layout or kernel_layout.decode_layout())


def parameter_count(params) -> int:
  return int(sum(np.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params)))


def _shapes(tree):
  return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def int8_draft_shapes(target_params: Mapping[str, Any]) -> dict:
  """ShapeDtypeStructs of Int8Drafter.draft_params(target_params) as an accelerator gets
  them (every matrix [out, in]; the CPU kernel's VNNI build gets them tiled), without
  quantizing.

  jaxspec.model.quantization.int8_decoder decides which leaves turn int8: it runs on a
  stand-in of the target with every leaf one element wide, and each leaf it returns is
  sized from the target's: a leaf the target has under the same name keeps its shape and
  dtype; the two leaves that replace a quantized matrix [rows, cols] (the only target
  leaf of that parent missing from the result) are the int8 matrix [rows, cols] and its
  float32 scales [rows].
  """
  target = kernel_layout.transposed_kernels(_shapes(target_params))['params']
  stand_in = jax.tree_util.tree_map(
      lambda leaf: np.ones((1,) * len(leaf.shape), np.float32), target)
  draft = int8_decoder({'params': stand_in}, tiled=False)['params']

  def sized(draft_tree, target_tree):
    out = {}
    replaced = [key for key in target_tree if key not in draft_tree]
    for key, value in draft_tree.items():
      if isinstance(value, Mapping):
        out[key] = sized(value, target_tree[key])
      elif key in target_tree:
        out[key] = jax.ShapeDtypeStruct(target_tree[key].shape, target_tree[key].dtype)
      else:
        if len(replaced) != 1:
          raise ValueError(f'cannot tell which target leaf {key!r} quantizes: {replaced}')
        rows, cols = target_tree[replaced[0]].shape
        out[key] = (jax.ShapeDtypeStruct((rows, cols), jnp.int8) if value.dtype == np.int8
                    else jax.ShapeDtypeStruct((rows,), jnp.float32))
    return out

  return {'params': sized(draft, target)}


@functools.partial(jax.jit, static_argnames=('shape',))
def _random_int8(key, *, shape):
  return jax.random.randint(key, shape, -127, 128, jnp.int8)


def random_int8_draft_params(target_params: Mapping[str, Any], seed: int = 0) -> dict:
  """Random params of the shapes of the int8 draft of `target_params` (int8_draft_shapes),
  made on the device (quantizing a multi-GB decoder on the host would take minutes, and
  the values do not change what a step costs): int8 matrices uniform in [-127, 127]
  with scales 1 / (127 sqrt(columns)); the leaves that stay in the target's dtype
  (norms, the cross-attention projections the draft never applies) random as the
  target's are."""
  shapes = int8_draft_shapes(target_params)
  key = jax.random.PRNGKey(seed)
  counter = [0]

  def fill(tree):
    out = {}
    int8_columns = [v.shape[1] for v in tree.values()
                    if not isinstance(v, Mapping) and v.dtype == jnp.int8]
    for name, value in tree.items():
      counter[0] += 1
      leaf_key = jax.random.fold_in(key, counter[0])
      if isinstance(value, Mapping):
        out[name] = fill(value)
      elif value.dtype == jnp.int8:
        out[name] = _random_int8(leaf_key, shape=value.shape)
      elif int8_columns and value.dtype == jnp.float32 and len(value.shape) == 1:
        out[name] = jnp.full(value.shape, 1.0 / (127.0 * np.sqrt(int8_columns[0])), jnp.float32)
      else:  # [out, in] kernels (transposed), biases and norm scales
        std = 1.0 / float(np.sqrt(value.shape[1])) if len(value.shape) == 2 else None
        out[name] = _random_leaf(leaf_key, shape=tuple(value.shape), dtype=value.dtype, std=std)
    return out

  return {'params': fill(shapes['params'])}


# ---------------------------------------------------------------------------
# What a decode step reads.

# The cross-attention key/value projections: applied to the encoding by init_cache only.
_CROSS_PROJECTION_PATHS = {('encoder_decoder_attention', 'key'),
                           ('encoder_decoder_attention', 'value')}


def _weight_bytes_read_per_step(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> int:
  total = 0
  for key, value in tree.items():
    where = path + (key,)
    if isinstance(value, Mapping):
      if where[-2:] in _CROSS_PROJECTION_PATHS:
        continue
      total += _weight_bytes_read_per_step(value, where)
    else:
      total += int(np.prod(value.shape)) * jnp.dtype(value.dtype).itemsize
  return total


def decode_step_bytes(params: Mapping[str, Any], config: T5Config, cache) -> int:
  """The bytes a cached decode step must read: every decoder weight it multiplies by
  (not the cross-attention key/value projections, applied once per input by
  init_cache; the token embedding only where the logits go through it) and the whole
  cache (self-attention buffers of max_length and the cross-attention keys/values,
  which attention reads in full, masked)."""
  tree = params['params']
  weights = _weight_bytes_read_per_step(tree['decoder'])
  if config.logits_via_embedding and 'token_embedder' in tree:
    weights += _weight_bytes_read_per_step(tree['token_embedder'])
  cache_bytes = sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
                    for layer in cache.layers for leaf in jax.tree_util.tree_leaves(layer))
  return weights + cache_bytes


def bandwidth_fraction(bytes_read: float, seconds: float,
                       peak: float | None) -> float | None:
  """bytes / seconds / peak (None without a peak)."""
  if peak is None or not seconds or seconds <= 0:
    return None
  return bytes_read / seconds / peak


# ---------------------------------------------------------------------------
# Timed calls.


_empty_cache = jax.jit(step_costs._empty_cache,  # pylint: disable=protected-access
                       static_argnames=('config', 'setup'))


def empty_cache(params, config: T5Config, setup: step_costs.StepCostSetup):
  """A target's DecoderCache for `setup` (step_costs' own, jitted: run eagerly, an XXL
  encoder would dispatch, and on an accelerator compile, operation by operation)."""
  return _empty_cache(params, config, setup)


def step_calls(params, config: T5Config, setup: step_costs.StepCostSetup,
               positions: Sequence[int], cache=None) -> dict[int, Callable[[], jax.Array]]:
  """{k: call}: setup.steps_per_call cached decode steps over k positions (step_costs'
  fori_loop, one compile per k), from a cache holding setup.cache_position positions."""
  cache = empty_cache(params, config, setup) if cache is None else cache
  return {k: functools.partial(
      step_costs._decode_steps, params, cache,  # pylint: disable=protected-access
      jnp.ones((setup.batch_size, k), jnp.int32), config=config,
      num_steps=setup.steps_per_call, cache_position=setup.cache_position)
          for k in sorted(set(positions))}


def proposal_calls(drafter, params, setup: step_costs.StepCostSetup, gamma: int
                   ) -> dict[int, Callable[[], jax.Array]]:
  """{n: call} for n in step_costs.INT8_PROPOSAL_CALLS: n greedy proposals of gamma
  tokens in one jitted loop (benchmark.propose_calls: one compile for both n)."""
  encoder_tokens = jnp.ones((setup.batch_size, setup.source_length), jnp.int32)
  tokens = jnp.ones((setup.batch_size, setup.cache_length - gamma), jnp.int32)
  return {count: functools.partial(
      benchmark.propose_calls, params, encoder_tokens, tokens, count, drafter=drafter,
      gamma=gamma, cache_length=setup.cache_length, sampling=SamplingConfig())
          for count in step_costs.INT8_PROPOSAL_CALLS}


def time_calls(calls: Mapping[Any, Callable[[], Any]], repeats: int
               ) -> tuple[dict[Any, np.ndarray], float]:
  """({name: seconds of each repetition}, seconds of the first calls): each call run
  once and waited for (compilation), then all interleaved (step_costs.interleaved_times)."""
  start = time.perf_counter()
  for call in calls.values():
    jax.block_until_ready(call())
  first = time.perf_counter() - start
  return step_costs.interleaved_times(calls, repeats), first


def step_seconds(times: Mapping[Any, np.ndarray], key, setup: step_costs.StepCostSetup) -> float:
  """Seconds of one decode step from step_calls' times: the fastest repetition (other
  load only ever adds time), over setup.steps_per_call."""
  return float(np.min(times[key])) / setup.steps_per_call


def ratio(times: Mapping[Any, np.ndarray], key, one_key) -> float:
  """V(k): the median over repetitions of time(k) / time(1), as step_costs reports it
  (exactly 1.0 for k = 1 itself)."""
  if key == one_key:
    return 1.0
  return float(np.median(times[key] / times[one_key]))


def slope_seconds(times: Mapping[Any, np.ndarray], prefix=()) -> float:
  """Seconds of one iteration of a loop timed at the two lengths of
  step_costs.INT8_PROPOSAL_CALLS (proposal_calls' times, keyed prefix + (n,)): the
  difference of the fastest repetitions of the long and the short loop, per iteration,
  so what a call costs besides its iterations (dispatch, set-up) cancels out."""
  short, long = step_costs.INT8_PROPOSAL_CALLS
  key = lambda n: prefix + (n,) if prefix else n  # noqa: E731
  return float(np.min(times[key(long)]) - np.min(times[key(short)])) / (long - short)


# ---------------------------------------------------------------------------
# The speculative loop against its parts.


@functools.partial(jax.jit, static_argnames=('target_config', 'drafter', 'spec',
                                             'max_decode_length'))
def _loop_prologue(target_params, drafter_params, encoder_tokens, *, target_config, drafter,
                   spec, max_decode_length):
  """What speculative_generate does before its while loop: the target's encoding and
  cache, the drafter's state."""
  target_cache, encoded = speculative._encode(  # pylint: disable=protected-access
      target_params, encoder_tokens, target_config=target_config,
      cache_length=speculative._target_cache_length(  # pylint: disable=protected-access
          spec, max_decode_length))
  state = drafter.init_state_for_decode(drafter_params, encoder_tokens, encoded,
                                        max_decode_length + spec.gamma, target_cache)
  return target_cache, state


def loop_overhead(target_params, target_config: T5Config, drafter, drafter_params, *,
                  gamma: int, max_decode_length: int, setup: step_costs.StepCostSetup,
                  repeats: int, seed: int = 0) -> dict:
  """The jitted speculative loop per iteration against a proposal and a verify step
  timed apart (each the slope between two loop lengths), all interleaved. 'overhead'
  is what an iteration costs beyond the two: the while loop's condition and
  bookkeeping (verdict, commit, statistics, rollbacks) and, on a GPU, the host's wait
  on the loop condition at every iteration.

  Greedy, batch setup.batch_size, random source tokens; per iteration = (the whole
  call - its prologue, the encoding and cache set-up) / target calls; each time the
  fastest repetition.
  """
  spec = SpeculativeConfig(gamma=gamma)
  rng = np.random.default_rng(seed)
  encoder_tokens = jnp.asarray(rng.integers(
      2, target_config.vocab_size, (setup.batch_size, setup.source_length)), jnp.int32)
  # The jitted loop itself (speculative_generate without its host-side argument checks).
  call_loop = functools.partial(
      speculative._speculative_generate,  # pylint: disable=protected-access
      target_params, drafter_params, encoder_tokens, jax.random.PRNGKey(seed),
      target_config=target_config, drafter=drafter, spec=spec,
      max_decode_length=max_decode_length, sampling=SamplingConfig(), eos_id=EOS_ID)
  calls = {'loop': call_loop,
           'prologue': functools.partial(
               _loop_prologue, target_params, drafter_params, encoder_tokens,
               target_config=target_config, drafter=drafter, spec=spec,
               max_decode_length=max_decode_length),
           # Verify steps over gamma + 1 positions in loops of two lengths (their slope:
           # no dispatch cost), from the same source tokens.
           **{('verify', n): functools.partial(
               benchmark._decode_steps,  # pylint: disable=protected-access
               target_params, encoder_tokens, n, config=target_config,
               tokens_per_step=gamma + 1, cache_length=setup.cache_length)
              for n in step_costs.INT8_PROPOSAL_CALLS},
           **{('proposal', n): call for n, call in proposal_calls(
               drafter, drafter_params, setup, gamma).items()}}
  times, first = time_calls(calls, repeats)
  result = jax.block_until_ready(call_loop())
  iterations = int(result.stats.target_calls)
  per_iteration = float(np.min(times['loop']) - np.min(times['prologue'])) / max(iterations, 1)
  proposal = slope_seconds(times, ('proposal',))
  verify = slope_seconds(times, ('verify',))
  return {
      'gamma': gamma, 'batch': setup.batch_size, 'max_decode_length': max_decode_length,
      'iterations': iterations, 'tokens': int(np.sum(np.asarray(result.output.lengths))),
      'loop_ms': 1e3 * float(np.min(times['loop'])),
      'prologue_ms': 1e3 * float(np.min(times['prologue'])),
      'iteration_ms': 1e3 * per_iteration, 'proposal_ms': 1e3 * proposal,
      'verify_ms': 1e3 * verify,
      'overhead_ms': 1e3 * (per_iteration - proposal - verify),
      'overhead_fraction': (per_iteration - proposal - verify) / per_iteration
      if per_iteration > 0 else None,
      'first_calls_s': first}


# ---------------------------------------------------------------------------
# Whole decodes.


def _pad_rows(rows: np.ndarray, size: int) -> np.ndarray:
  return np.pad(rows, ((0, size - len(rows)),) + ((0, 0),) * (rows.ndim - 1), mode='edge')


# gamma='auto' in part d: calibration rounds (each decodes every batch with every
# candidate) and the seconds of decoding past the first round that may go to more.
AUTO_CALIBRATION_ROUNDS = (2, 3)
AUTO_CALIBRATION_SECONDS = 5.0


def end_to_end(target_params, target_config: T5Config, drafters: Mapping[str, tuple[Any, Any]],
               inputs: np.ndarray, *, batch: int, temperature: float, gamma: int,
               max_decode_length: int, repeats: int, seed: int = 0,
               baseline: bool = True, auto_gammas: Sequence[int] = ()
               ) -> tuple[dict, float, dict[str, np.ndarray]]:
  """The baseline and speculative decoding with each of `drafters` ({name: (drafter,
  params)}) over the same inputs [n, s] in batches of `batch` (the last padded with
  its last row), interleaved batch by batch and repeated (benchmark.time_side_by_side).

  auto_gammas: also gamma='auto' ('auto', jaxspec.decoding.auto_gamma's decoder over the
  baseline and the first drafter, choosing among 0 and these), calibrated on the same
  batches before the timings (its seconds in 'calibration_s'), timed beside the others
  with what it chose per batch ('gamma_counts', 'chose_baseline').

  Returns ({name: {seconds (median total), tokens, tokens_per_s, and for the drafters
  speedup (the baseline's seconds / these), alpha, tokens_per_target_call,
  identical_outputs}}, seconds of the first calls (compilation), {name: tokens [n, L]}),
  tokens counted over the n real rows. Row i samples with fold_in(PRNGKey(seed), i) in
  both decoders; identical_outputs (temperature 0 only) says every row's tokens equal
  the baseline's."""
  count = len(inputs)
  batches = -(-count // batch)
  padded = _pad_rows(np.asarray(inputs), batches * batch)
  keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
      jax.random.PRNGKey(seed), jnp.arange(len(padded)))
  sampling = SamplingConfig(temperature=temperature)
  rows = lambda i: slice(i * batch, (i + 1) * batch)  # noqa: E731

  decoders = {}
  if baseline:
    decoders['baseline'] = lambda i: generate(
        target_params, padded[rows(i)], keys[rows(i)], config=target_config,
        max_decode_length=max_decode_length, sampling=sampling, on_nonfinite='warn')
  for name, (drafter, drafter_params) in drafters.items():
    decoders[name] = (lambda d, p: lambda i: speculative_generate(
        target_params, p, padded[rows(i)], keys[rows(i)], target_config=target_config,
        drafter=d, spec=SpeculativeConfig(gamma=gamma), max_decode_length=max_decode_length,
        sampling=sampling, on_nonfinite='warn'))(drafter, drafter_params)
  start = time.perf_counter()
  for decode in decoders.values():  # compile, timed apart
    jax.block_until_ready(decode(0))
  first = time.perf_counter() - start
  auto = None
  if auto_gammas:
    drafter, drafter_params = next(iter(drafters.values()))
    auto, calibration_s = _calibrated_auto(
        target_params, target_config, drafter, drafter_params,
        [(padded[rows(i)], keys[rows(i)]) for i in range(batches)], batch=batch,
        sampling=sampling, max_decode_length=max_decode_length, gammas=auto_gammas)
    decoders['auto'] = lambda i: auto((padded[rows(i)], keys[rows(i)]))
  outputs: dict[str, list] = {}
  totals = benchmark.time_side_by_side(decoders, batches, repeats, outputs)

  def tokens_of(name):
    out = [o if name == 'baseline' else o.output for o in outputs[name]]
    return np.concatenate([np.asarray(o.tokens) for o in out])[:count], np.concatenate(
        [np.asarray(o.lengths) for o in out])[:count]

  results = {}
  reference = tokens_of('baseline')[0] if baseline else None
  for name in decoders:
    tokens, lengths = tokens_of(name)
    seconds = float(np.median(totals[name]))
    row = {'seconds': seconds, 'tokens': int(lengths.sum()),
           'tokens_per_s': float(lengths.sum()) / seconds}
    if name != 'baseline':
      stats = [o.stats for o in outputs[name]]
      verified = sum(int(s.verified_positions) for s in stats)
      calls = sum(int(np.sum(np.asarray(s.row_target_calls)[:count - i * batch]))
                  for i, s in enumerate(stats))
      row.update(
          alpha=sum(float(s.overlap_sum) for s in stats) / max(verified, 1),
          tokens_per_target_call=row['tokens'] / max(calls, 1),
          identical_outputs=(bool(np.array_equal(tokens, reference))
                             if temperature == 0.0 and reference is not None else None))
      if baseline:
        row['speedup'] = float(np.median(totals['baseline'])) / seconds
    results[name] = row
  if auto is not None:
    results['auto'].update(_auto_choices(auto), calibration_s=calibration_s)
  return results, first, {name: tokens_of(name)[0] for name in decoders}


def _calibrated_auto(target_params, target_config: T5Config, drafter, drafter_params,
                     batch_arrays: Sequence[tuple[Any, Any]], *, batch: int,
                     sampling: SamplingConfig, max_decode_length: int,
                     gammas: Sequence[int]) -> tuple[auto_gamma.AutoGammaDecoder, float]:
  """gamma='auto' over the baseline and `drafter` (their calls exactly end_to_end's, so
  the programs they share compile once), calibrated on batch_arrays [(tokens, keys)]
  as jaxspec-infer calibrates (each candidate compiled untimed, then interleaved
  rounds): (the decoder, the calibration's seconds, compiles included)."""
  auto = auto_gamma.AutoGammaDecoder(
      lambda arrays: generate(target_params, *arrays, config=target_config,
                              max_decode_length=max_decode_length, sampling=sampling,
                              on_nonfinite='warn'),
      lambda arrays, spec: speculative_generate(
          target_params, drafter_params, *arrays, target_config=target_config,
          drafter=drafter, spec=spec, max_decode_length=max_decode_length,
          sampling=sampling, on_nonfinite='warn'),
      SpeculativeConfig(gamma=auto_gamma.AUTO), batch_size=batch, gammas=gammas)
  start = time.perf_counter()
  auto.calibrate(batch_arrays, AUTO_CALIBRATION_ROUNDS, AUTO_CALIBRATION_SECONDS)
  return auto, time.perf_counter() - start


def _auto_choices(auto: auto_gamma.AutoGammaDecoder) -> dict:
  """What gamma='auto' chose over a run and why: its choices per batch (calls of the
  timed repetitions and the first call), whether it ran the baseline throughout, and
  each gamma's speedup its calibration measured (with the alpha it measured)."""
  return {'gammas': list(auto.gammas),
          'gamma_counts': {int(g): n for g, n in sorted(auto.gamma_counts.items())},
          'chose_baseline': set(auto.gamma_counts) == {0},
          'calibration_speedups': {int(g): float(v)
                                   for g, v in sorted(auto.costs.measured_speedup.items())},
          'calibration_alpha': auto.costs.alpha}


# ---------------------------------------------------------------------------
# The paper's Table 2 (Leviathan et al. 2023): T5-XXL target, T5.1.1 drafts; alpha from
# Table 3, gamma and walltime speedup from Table 2 (TPU v4, batch 1), c from Table 4.

PAPER_TABLE2: tuple[dict, ...] = tuple(
    {'task': task, 'draft': draft, 'temperature': temperature, 'paper_gamma': gamma,
     'alpha': alpha, 'paper_speedup': speedup, 'paper_c': c}
    for task, draft, temperature, gamma, alpha, speedup, c in (
        ('EnDe', 'small', 0, 7, 0.75, 3.4, 0.02), ('EnDe', 'base', 0, 7, 0.80, 2.8, 0.04),
        ('EnDe', 'large', 0, 7, 0.82, 1.7, 0.11), ('EnDe', 'small', 1, 7, 0.62, 2.6, 0.02),
        ('EnDe', 'base', 1, 5, 0.68, 2.4, 0.04), ('EnDe', 'large', 1, 3, 0.71, 1.4, 0.11),
        ('CNNDM', 'small', 0, 5, 0.65, 3.1, 0.02), ('CNNDM', 'base', 0, 5, 0.73, 3.0, 0.04),
        ('CNNDM', 'large', 0, 3, 0.74, 2.2, 0.11), ('CNNDM', 'small', 1, 5, 0.53, 2.3, 0.02),
        ('CNNDM', 'base', 1, 3, 0.55, 2.2, 0.04), ('CNNDM', 'large', 1, 3, 0.56, 1.7, 0.11)))


def predicted_speedup(alpha: float, gamma: int, c: float, verify_cost: float) -> float:
  """Theorem 3.8 with a measured verify step: E[tokens per iteration] (Eq. 1) over
  gamma draft steps of c and one verify step of V(gamma + 1) one-position steps."""
  return float(analysis.expected_tokens_per_iteration(alpha, gamma)) / (
      gamma * c + verify_cost)


def draft_cost_by_branches(step_ms_by_batch: Mapping[int, float], target_step_ms: float,
                           max_drafts: int = tree_sizing.MAX_DRAFTS) -> float | dict[int, float]:
  """c of a tree's m branches, drafted as one batch of m rows: {m: the draft's step at
  batch m / the target's one-position step} for m up to max_drafts, linear between the
  batch sizes measured and never past the largest; the batch-1 c alone where only that
  was measured (a tree's drafting then taken as costing a chain's)."""
  measured = {int(b): float(ms) for b, ms in step_ms_by_batch.items()}
  if set(measured) == {1}:
    return measured[1] / target_step_ms
  batches = sorted(measured)
  return {m: float(np.interp(m, batches, [measured[b] for b in batches])) / target_step_ms
          for m in range(1, max_drafts + 1) if batches[0] <= m <= batches[-1]}


def table2_predictions(draft_c: Mapping[str, float | None], verify_cost: Mapping[int, float],
                       rows: Sequence[dict] = PAPER_TABLE2,
                       branch_c: Mapping[str, float | Mapping[int, float]] | None = None
                       ) -> list[dict]:
  """Each of the paper's rows with its speedup predicted from this device's costs.

  draft_c: {draft: c} (None: not measured); verify_cost: {k: V(k)} measured on the
  target (k >= 2). The best gamma is the one (among gamma = k - 1 with V(k) measured)
  that maximizes the predicted speedup, as the paper picks gamma per row; the speedup at
  the paper's gamma where V(paper gamma + 1) was measured; and Theorem 3.8 as stated
  (a verify step costs one step) with the measured c, at its own optimal gamma.
  best_chain and best_tree: the shapes jaxspec.measure.tree_sizing sizes for these
  costs (V interpolated between the measured k, never past them; a tree of m branches
  of gamma drafts verified in one step over 1 + m gamma positions, its later branches'
  acceptance by tree_sizing's model), each {num_drafts, gamma, positions, tokens, cost,
  speedup}; branch_c: {draft: c, or {m: c of drafting m branches as a batch}}
  (draft_cost_by_branches), default draft_c's.
  """
  gammas = sorted(k - 1 for k in verify_cost if k >= 2)
  out = []
  for row in rows:
    c = draft_c.get(row['draft'])
    result = dict(row, c=c, best_gamma=None, predicted_speedup=None,
                  predicted_at_paper_gamma=None, theorem_3_8_gamma=None,
                  theorem_3_8_speedup=None, best_chain=None, best_tree=None)
    if c is not None and gammas:
      chain, tree = tree_sizing.best_chain_and_tree(
          verify_cost, (branch_c or {}).get(row['draft'], c), row['alpha'])
      result.update(best_chain=chain.to_json(), best_tree=tree.to_json())
      speedups = {g: predicted_speedup(row['alpha'], g, c, verify_cost[g + 1]) for g in gammas}
      best = max(gammas, key=lambda g: (speedups[g], -g))
      result.update(best_gamma=best, predicted_speedup=speedups[best],
                    verify_cost=verify_cost[best + 1],
                    predicted_at_paper_gamma=speedups.get(row['paper_gamma']))
      ideal = analysis.optimal_gamma(row['alpha'], c, max_gamma=16)
      result.update(theorem_3_8_gamma=ideal, theorem_3_8_speedup=float(
          analysis.expected_speedup(row['alpha'], ideal, c)))
    out.append(result)
  return out


class Budget:
  """Wall-clock budgets: the total split among the parts still to run in proportion to
  their shares, so time a part leaves unused goes to the later ones."""

  def __init__(self, total_seconds: float, shares: Mapping[str, float],
               clock: Callable[[], float] = time.perf_counter):
    self.clock = clock
    self.start = clock()
    self.total = float(total_seconds)
    self.shares = dict(shares)
    self.part_deadline = self.start + self.total

  def remaining(self) -> float:
    return self.start + self.total - self.clock()

  def begin(self, part: str, later: Sequence[str]) -> float:
    """Starts `part` (the parts in `later` still to come): its deadline, returned as
    seconds from now."""
    weights = self.shares.get(part, 0.0) + sum(self.shares.get(p, 0.0) for p in later)
    share = self.shares.get(part, 0.0) / weights if weights > 0 else 1.0
    seconds = max(self.remaining(), 0.0) * share
    self.part_deadline = self.clock() + seconds
    return seconds

  def allows(self, estimate: float = 0.0) -> bool:
    """Whether work expected to take `estimate` seconds ends before the part's deadline."""
    return self.clock() + estimate <= self.part_deadline

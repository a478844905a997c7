"""Where a decode's time goes on the device: jax.profiler traces of a few programs, parsed.

The accelerator command's profile part (jaxspec/launch/accelerator_bench.py, part p)
traces, one program a trace, each once compiled and run:

  the speculative loop (a T5 target and draft, greedy), in each draft loop form
      (SpeculativeConfig.draft_loop), and its prologue (the encoding and caches), so
      that what an iteration runs is the loop's count less the prologue's, over the
      iterations;
  a run of proposals from a prepared draft cache (DraftContext.draft_loop of each form,
      a trip count XLA sees around them): kernels per draft step;
  a run of the target's verify steps over gamma + 1 positions: kernels per verify step;

and reads from each trace (the Chrome trace-event JSON that jax.profiler writes beside
its .xplane.pb, no TensorBoard plugin needed):

  kernels      the device's operations: on a GPU the kernels on its streams, on a TPU
               its 'XLA Ops' line; on the CPU, which has no device streams, the XLA:CPU
               operations (thunks) its runtime records, containers (while, conditional,
               call) left out since their contents count;
  d2h_copies   device-to-host copies on the device's streams (a GPU while loop whose
               trip count XLA cannot see copies its condition every iteration), and
               d2h_calls the host's copy calls (cuMemcpyDtoH...);
  host_waits   the host's calls that wait for the device (cuStreamSynchronize,
               cuEventSynchronize, BlockHostUntilDone, ...): 0 on the CPU;
  idle         the time within the traced program's span when no device operation ran
               (the sum of the gaps between them, streams merged): launch latency and
               host round trips. On the CPU, the gaps between thunks;
  kinds        the kernels by kind (the name less XLA's instance numbers), those that
               ran longest first, per draft and per verify step: which fusions and
               products a step's time goes to.

Nothing here parses flags or writes records; the launcher does.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding import speculative
from jaxspec.decoding.drafters.base import DraftContext, Drafter
from jaxspec.decoding.speculative import SpeculativeConfig
from jaxspec.measure import accelerator, step_costs
from jaxspec.sampling import SamplingConfig

# ---------------------------------------------------------------------------
# Reading a trace.

_COPY = re.compile(r'memcpy|memset|^copy[ _]?(h|d)to(h|d)', re.IGNORECASE)
_DEVICE_TO_HOST = re.compile(r'dtoh|d2h|device ?to ?host', re.IGNORECASE)
_HOST_COPY_CALL = re.compile(r'(cu|cuda|hip)memcpy\w*dtoh|memcpy.*devicetohost', re.IGNORECASE)
_HOST_WAIT = re.compile(r'synchronize|blockhostuntildone', re.IGNORECASE)
# XLA:CPU thunks that contain others (their contents are counted, not themselves).
_CONTAINER_OP = re.compile(r'^(while|conditional|call|async)', re.IGNORECASE)
# A kernel's kind: its name less the numbers XLA appends to tell instances apart
# ('loop_multiply_fusion_12' and 'loop_multiply_fusion_3' are one kind).
_INSTANCE_SUFFIX = re.compile(r'([._]\d+)+$')
KERNEL_KINDS = 12  # the kinds a record lists, those that took longest first


@dataclasses.dataclass(frozen=True)
class Event:
  """One complete trace event: microseconds from the trace's start."""
  name: str
  start: float
  duration: float
  process: str
  thread: str
  args: Mapping[str, Any]

  @property
  def end(self) -> float:
    return self.start + self.duration


def trace_file(log_dir: str) -> str:
  """The Chrome trace-event JSON jax.profiler wrote under log_dir (the Perfetto one
  where it made both)."""
  found = sorted(glob.glob(os.path.join(log_dir, '**', '*.json.gz'), recursive=True))
  if not found:
    raise FileNotFoundError(f'no trace (*.json.gz) under {log_dir}')
  perfetto = [path for path in found if os.path.basename(path).startswith('perfetto')]
  return (perfetto or found)[-1]


def load_events(path: str) -> list[Event]:
  """The complete events ('X') of a Chrome trace-event JSON file, with the names of
  their processes and threads."""
  with gzip.open(path, 'rt') as f:
    data = json.load(f)
  raw = data['traceEvents'] if isinstance(data, dict) else data
  processes, threads = {}, {}
  for event in raw:
    if event.get('ph') != 'M':
      continue
    name = (event.get('args') or {}).get('name', '')
    if event.get('name') == 'process_name':
      processes[event.get('pid')] = name
    elif event.get('name') == 'thread_name':
      threads[event.get('pid'), event.get('tid')] = name
  return [Event(name=str(e.get('name', '')), start=float(e.get('ts', 0.0)),
                duration=float(e.get('dur', 0.0)), process=processes.get(e.get('pid'), ''),
                thread=threads.get((e.get('pid'), e.get('tid')), ''),
                args=e.get('args') or {})
          for e in raw if e.get('ph') == 'X']


def _on_device(event: Event) -> bool:
  return event.process.startswith('/device:')


def device_events(events: Sequence[Event]) -> tuple[str, list[Event]]:
  """(what they are, the device's operations and copies): a GPU's stream lines, else a
  TPU's 'XLA Ops' line, else (the CPU) the XLA:CPU thunks the host's runtime records."""
  device = [e for e in events if _on_device(e)]
  streams = [e for e in device if 'stream' in e.thread.lower()]
  if streams:
    return 'device streams', streams
  ops = [e for e in device if e.thread.lower() == 'xla ops']
  if ops:
    return 'device XLA ops', ops
  thunks = [e for e in events if not _on_device(e) and 'hlo_op' in e.args
            and not e.name.startswith('end: ')
            and not _CONTAINER_OP.match(str(e.args.get('hlo_op', '')))]
  # Neither: a device whose profiler recorded no operations (e.g. no CUPTI).
  return ('XLA:CPU thunks (host)' if thunks else 'no device operations traced'), thunks


def busy_and_span(events: Iterable[Event]) -> tuple[float, float]:
  """(microseconds when some event ran, microseconds from the first start to the last
  end): the union of the events' intervals, and their span."""
  intervals = sorted((e.start, e.end) for e in events)
  if not intervals:
    return 0.0, 0.0
  busy, (start, end) = 0.0, intervals[0]
  first, last = start, end
  for interval_start, interval_end in intervals[1:]:
    last = max(last, interval_end)
    if interval_start > end:
      busy, start, end = busy + end - start, interval_start, interval_end
    else:
      end = max(end, interval_end)
  return busy + end - start, last - first


@dataclasses.dataclass(frozen=True)
class TraceCounts:
  """What one traced program did on the device and how the host waited for it."""
  source: str  # where the operations were read (device_events)
  kernels: int
  d2h_copies: int  # device-to-host copies on the device's lines
  d2h_calls: int  # the host's device-to-host copy calls
  host_waits: int
  busy_ms: float
  span_ms: float
  # (kind, kernels, microseconds) of the KERNEL_KINDS kinds that ran longest
  kinds: tuple[tuple[str, int, float], ...] = ()

  @property
  def idle_ms(self) -> float:
    return self.span_ms - self.busy_ms

  def minus(self, other: 'TraceCounts') -> dict[str, float]:
    """The counts of this program less another's (a loop less its prologue)."""
    return {name: getattr(self, name) - getattr(other, name)
            for name in ('kernels', 'd2h_copies', 'd2h_calls', 'host_waits')}


def kernel_kind(name: str) -> str:
  """A kernel's kind: its name without XLA's instance numbers."""
  return _INSTANCE_SUFFIX.sub('', name) or name


def kernel_kinds(kernels: Iterable[Event], top: int = KERNEL_KINDS
                 ) -> tuple[tuple[str, int, float], ...]:
  """((kind, kernels, microseconds), ...) of the `top` kinds that ran longest: where
  a step's time goes, by what XLA made of it (fusions, products, copies)."""
  counts: dict[str, list] = {}
  for event in kernels:
    entry = counts.setdefault(kernel_kind(event.name), [0, 0.0])
    entry[0] += 1
    entry[1] += event.duration
  ranked = sorted(counts.items(), key=lambda item: (-item[1][1], item[0]))[:top]
  return tuple((kind, count, micros) for kind, (count, micros) in ranked)


def count_events(events: Sequence[Event], module: str | None = None) -> TraceCounts:
  """TraceCounts of a trace's events; module: keep the device operations of the XLA
  modules whose name holds it (where the events name their module)."""
  source, operations = device_events(events)
  if module is not None:
    named = [e for e in operations if module in str(e.args.get('hlo_module', ''))]
    operations = named or operations
  copies = [e for e in operations if _COPY.search(e.name)]
  kernels = [e for e in operations if not _COPY.search(e.name)]
  host = [e for e in events if not _on_device(e)]
  busy, span = busy_and_span(operations)
  return TraceCounts(
      source=source, kernels=len(kernels),
      d2h_copies=sum(1 for e in copies if _DEVICE_TO_HOST.search(e.name)),
      d2h_calls=sum(1 for e in host if _HOST_COPY_CALL.search(e.name)),
      host_waits=sum(1 for e in host if _HOST_WAIT.search(e.name)),
      busy_ms=busy / 1e3, span_ms=span / 1e3, kinds=kernel_kinds(kernels))


def traced(call: Callable[[], Any], module: str | None = None,
           log_dir: str | None = None) -> TraceCounts:
  """Runs call() once under jax.profiler and counts what its trace holds. Compile and
  warm it first: a trace of a compile holds the compile."""
  with tempfile.TemporaryDirectory(prefix='jaxspec-profile-') as scratch:
    directory = log_dir or scratch
    with jax.profiler.trace(directory, create_perfetto_trace=True):
      jax.block_until_ready(call())
    return count_events(load_events(trace_file(directory)), module)


# ---------------------------------------------------------------------------
# The programs.


@functools.partial(jax.jit, static_argnames=('drafter', 'max_length'))
def _draft_state(params, encoder_tokens, *, drafter: Drafter, max_length: int):
  return drafter.init_state(params, encoder_tokens, max_length)


@functools.partial(jax.jit, static_argnames=('drafter', 'gamma', 'num_proposals',
                                             'draft_loop'))
def _proposals(params, state, encoder_tokens, tokens, length, keys, *, drafter: Drafter,
               gamma: int, num_proposals: int, draft_loop: str):
  """num_proposals greedy proposals of gamma tokens from a prepared drafter state (a
  trip count XLA sees), each fed the drafts of the one before, all from `length`."""
  def call(_, carry):
    state, tokens = carry
    context = DraftContext(tokens=tokens, length=length, encoder_tokens=encoder_tokens,
                           draft_loop=draft_loop)
    drafts, _, state = drafter.propose(params, state, context, gamma, SamplingConfig(), keys)
    return state, jax.lax.dynamic_update_slice_in_dim(tokens, drafts, 1, axis=1)

  return jax.lax.fori_loop(0, num_proposals, call, (state, tokens))[1]


def proposal_call(drafter: Drafter, params, setup: step_costs.StepCostSetup, gamma: int,
                  num_proposals: int, draft_loop: str) -> Callable[[], jax.Array]:
  """A call of _proposals from a drafter state made once, at setup's cache position."""
  batch = setup.batch_size
  encoder_tokens = jnp.ones((batch, setup.source_length), jnp.int32)
  state = _draft_state(params, encoder_tokens, drafter=drafter, max_length=setup.cache_length)
  tokens = jnp.ones((batch, setup.cache_length - gamma), jnp.int32)
  length = jnp.full((batch,), setup.cache_position, jnp.int32)
  keys = jax.random.split(jax.random.PRNGKey(0), batch)
  return functools.partial(_proposals, params, state, encoder_tokens, tokens, length, keys,
                           drafter=drafter, gamma=gamma, num_proposals=num_proposals,
                           draft_loop=draft_loop)


def loop_calls(target_params, target_config: T5Config, drafter: Drafter, drafter_params, *,
               gamma: int, max_decode_length: int, encoder_tokens, draft_loop: str
               ) -> tuple[Callable[[], Any], Callable[[], Any]]:
  """(the jitted speculative loop, greedy, in the draft loop form, its prologue)."""
  spec = SpeculativeConfig(gamma=gamma, draft_loop=draft_loop)
  statics = dict(target_config=target_config, drafter=drafter, spec=spec,
                 max_decode_length=max_decode_length)
  loop = functools.partial(
      speculative._speculative_generate,  # pylint: disable=protected-access
      target_params, drafter_params, encoder_tokens, jax.random.PRNGKey(0),
      sampling=SamplingConfig(), eos_id=EOS_ID, **statics)
  prologue = functools.partial(
      accelerator._loop_prologue,  # pylint: disable=protected-access
      target_params, drafter_params, encoder_tokens, **statics)
  return loop, prologue


# ---------------------------------------------------------------------------
# The measurement.


@dataclasses.dataclass(frozen=True)
class ProfileSetup:
  """What the profile runs: the speculative loop's length, proposals a call, the forms."""
  gamma: int = 3
  max_decode_length: int = 64
  num_proposals: int = 8
  draft_loops: tuple[str, ...] = ('early_exit', 'static')
  repeats: int = 5
  trace: bool = True  # False: timings only


def _per(value: float, count: int) -> float | None:
  return value / count if count > 0 else None


def _loop_record(loop: TraceCounts, prologue: TraceCounts, iterations: int) -> dict:
  """A loop's trace per iteration: its counts less its prologue's, over the iterations."""
  counts = loop.minus(prologue)
  return {'kernels_per_iteration': _per(counts['kernels'], iterations),
          'd2h_copies_per_iteration': _per(counts['d2h_copies'], iterations),
          'd2h_calls_per_iteration': _per(counts['d2h_calls'], iterations),
          'host_waits_per_iteration': _per(counts['host_waits'], iterations),
          'idle_ms_per_iteration': _per(loop.idle_ms - prologue.idle_ms, iterations),
          'idle_fraction': loop.idle_ms / loop.span_ms if loop.span_ms > 0 else None,
          'span_ms': loop.span_ms, 'busy_ms': loop.busy_ms}


def _steps_record(counts: TraceCounts, steps: int, name: str) -> dict:
  """A run of `steps` draft or verify steps' trace, per step."""
  return {f'kernels_per_{name}': _per(counts.kernels, steps),
          f'd2h_copies_per_{name}': _per(counts.d2h_copies, steps),
          f'host_waits_per_{name}': _per(counts.host_waits, steps),
          'idle_fraction': counts.idle_ms / counts.span_ms if counts.span_ms > 0 else None,
          'span_ms': counts.span_ms, 'busy_ms': counts.busy_ms,
          # Where a step's kernels go: the kinds that ran longest, per step.
          'kernel_kinds': [{'kind': kind, f'kernels_per_{name}': _per(count, steps),
                            f'us_per_{name}': _per(micros, steps)}
                           for kind, count, micros in counts.kinds]}


def profile_decode(target_params, target_config: T5Config, drafter: Drafter, drafter_params,
                   *, setup: step_costs.StepCostSetup, profile: ProfileSetup,
                   seed: int = 0, deadline: Callable[[float], bool] = lambda _: True) -> dict:
  """The speculative loop and its parts, timed and traced in each draft loop form.

  Returns {'forms': {form: {'iteration_ms', 'iterations', 'proposal_ms' (a proposal of
  gamma tokens), 'loop': per-iteration trace counts, 'draft': per-draft-step counts}},
  'verify': per-verify-step counts, 'trace_source', 'first_calls_s', 'skipped'}: times
  the fastest of profile.repeats interleaved repetitions. deadline(estimate_s) says
  whether work expected to take that long still fits; forms that do not are skipped.
  """
  rng = np.random.default_rng(seed)
  encoder_tokens = jnp.asarray(rng.integers(
      2, target_config.vocab_size, (setup.batch_size, setup.source_length)), jnp.int32)
  gamma = profile.gamma
  verify = accelerator.step_calls(target_params, target_config, setup, [gamma + 1])[gamma + 1]
  out: dict[str, Any] = {'forms': {}, 'skipped': [], 'first_calls_s': 0.0}
  calls: dict[Any, Callable[[], Any]] = {'verify': verify}
  prologue = None
  spent = 0.0
  for form in profile.draft_loops:
    if not deadline(spent):
      out['skipped'].append({'draft_loop': form, 'reason': 'over the part budget'})
      continue
    start = time.perf_counter()
    loop, prologue = loop_calls(
        target_params, target_config, drafter, drafter_params, gamma=gamma,
        max_decode_length=profile.max_decode_length, encoder_tokens=encoder_tokens,
        draft_loop=form)
    calls['loop', form] = loop
    calls['proposals', form] = proposal_call(drafter, drafter_params, setup, gamma,
                                             profile.num_proposals, form)
    for name in (('loop', form), ('proposals', form)):  # compile, timed apart
      jax.block_until_ready(calls[name]())
    spent = time.perf_counter() - start
    out['first_calls_s'] += spent
  if prologue is None:
    return out
  calls['prologue'] = prologue
  start = time.perf_counter()
  jax.block_until_ready(verify())
  jax.block_until_ready(prologue())
  out['first_calls_s'] += time.perf_counter() - start
  times = step_costs.interleaved_times(calls, profile.repeats)
  fastest = {name: float(np.min(seconds)) for name, seconds in times.items()}
  traces = {}
  if profile.trace:
    traces = {name: traced(call, _module_of(name)) for name, call in calls.items()}
    out['trace_source'] = traces['verify'].source
    out['verify'] = _steps_record(traces['verify'], setup.steps_per_call, 'verify_step')
  out['verify_step_ms'] = 1e3 * fastest['verify'] / setup.steps_per_call
  for form in profile.draft_loops:
    if ('loop', form) not in calls:
      continue
    result = jax.block_until_ready(calls['loop', form]())
    iterations = int(result.stats.target_calls)
    entry = {
        'iterations': iterations,
        'tokens': int(np.sum(np.asarray(result.output.lengths))),
        'loop_ms': 1e3 * fastest['loop', form], 'prologue_ms': 1e3 * fastest['prologue'],
        'iteration_ms': 1e3 * (fastest['loop', form] - fastest['prologue']) / max(iterations, 1),
        'proposal_ms': 1e3 * fastest['proposals', form] / profile.num_proposals}
    entry['draft_token_ms'] = entry['proposal_ms'] / gamma
    if traces:
      entry['loop'] = _loop_record(traces['loop', form], traces['prologue'], iterations)
      entry['draft'] = _steps_record(traces['proposals', form],
                                     profile.num_proposals * gamma, 'draft_step')
    out['forms'][form] = entry
  return out


def _module_of(name) -> str:
  """The XLA module (jit name) of each profiled call."""
  if name == 'verify':
    return '_decode_steps'
  if name == 'prologue':
    return '_loop_prologue'
  return '_speculative_generate' if name[0] == 'loop' else '_proposals'

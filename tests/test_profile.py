"""jaxspec.measure.profile: reading jax.profiler's traces.

- Synthetic traces of a GPU, a TPU and the CPU, as jax.profiler writes them (Chrome
  trace-event JSON: process and thread names in metadata events, complete events with
  microsecond times): kernels counted on the GPU's streams only (not twice from a
  derived 'XLA Ops' line), device-to-host copies apart from other copies, the host's
  copy calls and waits, busy and idle time by the union of intervals (overlapping
  streams merged), a module filter; a TPU's 'XLA Ops' line; the CPU's thunks without
  their 'end:' markers and containers.
- A real trace of a jitted program on this CPU: a program of more operations counts
  more kernels, and a loop of n iterations n times its body's.
"""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from jaxspec.measure import profile


def _write_trace(path, processes, events):
  """processes {pid: (name, {tid: thread name})}; events [(pid, tid, name, ts, dur, args)]."""
  raw = []
  for pid, (name, threads) in processes.items():
    raw.append({'ph': 'M', 'pid': pid, 'name': 'process_name', 'args': {'name': name}})
    for tid, thread in threads.items():
      raw.append({'ph': 'M', 'pid': pid, 'tid': tid, 'name': 'thread_name',
                  'args': {'name': thread}})
  raw += [{'ph': 'X', 'pid': pid, 'tid': tid, 'name': name, 'ts': ts, 'dur': dur,
           'args': args or {}} for pid, tid, name, ts, dur, args in events]
  path.parent.mkdir(parents=True, exist_ok=True)
  with gzip.open(path, 'wt') as f:
    json.dump({'displayTimeUnit': 'ns', 'traceEvents': raw}, f)
  return path


GPU_PROCESSES = {1: ('/host:CPU', {10: 'python', 11: 'tf_XLATfrtGpuClient'}),
                 2: ('/device:GPU:0', {20: 'Stream #7(Compute)', 21: 'Stream #13(MemcpyD2H)',
                                       22: 'XLA Ops', 23: 'XLA Modules'})}
LOOP = {'hlo_module': 'jit__speculative_generate'}


def _gpu_events():
  return [
      (1, 10, 'PjitFunction(_speculative_generate)', 0, 50, None),
      (1, 11, 'cuLaunchKernel', 1, 1, None), (1, 11, 'cuLaunchKernel', 2, 1, None),
      (1, 11, 'cuMemcpyDtoHAsync_v2', 12, 1, None), (1, 11, 'cuStreamSynchronize', 13, 5, None),
      (1, 11, 'cuMemcpyDtoHAsync_v2', 27, 1, None), (1, 11, 'cuStreamSynchronize', 28, 2, None),
      (2, 20, 'loop_fusion_1', 0, 10, LOOP), (2, 20, 'input_reduce_fusion', 15, 5, LOOP),
      (2, 21, 'MemcpyD2H', 25, 1, LOOP), (2, 20, 'MemcpyD2D', 26, 1, LOOP),
      (2, 20, 'gemm_fusion', 30, 10, LOOP),
      (2, 20, 'fusion_of_another_module', 8, 4, {'hlo_module': 'jit_other'}),
      # Derived lines: the same operations again, never counted.
      (2, 22, 'fusion.1', 0, 10, LOOP), (2, 22, 'fusion.2', 15, 5, LOOP),
      (2, 23, 'jit__speculative_generate', 0, 40, None)]


def test_a_gpu_trace_counts_stream_kernels_copies_and_host_waits(tmp_path):
  path = _write_trace(tmp_path / 'plugins/profile/x/perfetto_trace.json.gz', GPU_PROCESSES,
                      _gpu_events())
  assert profile.trace_file(str(tmp_path)) == str(path)
  counts = profile.count_events(profile.load_events(str(path)), 'speculative_generate')
  assert counts.source == 'device streams'
  assert counts.kernels == 3  # the module's kernels, not the copies or the other module
  assert (counts.d2h_copies, counts.d2h_calls, counts.host_waits) == (1, 2, 2)
  # Busy: [0, 10] + [15, 20] + [25, 27] (two copies) + [30, 40] = 27 us of a 40 us span.
  assert counts.busy_ms == pytest.approx(0.027) and counts.span_ms == pytest.approx(0.040)
  assert counts.idle_ms == pytest.approx(0.013)
  # Without the filter the other module's kernel counts and fills part of a gap.
  everything = profile.count_events(profile.load_events(str(path)))
  assert everything.kernels == 4 and everything.busy_ms == pytest.approx(0.029)


def test_kernels_are_grouped_by_kind_the_longest_first():
  """A step's kernels by what XLA made of them: instance numbers dropped, kinds ranked by
  the time they took (the lever for fewer, larger kernels), copies apart."""
  def event(name, duration):
    return profile.Event(name, 0.0, duration, '/device:GPU:0', 'Stream #1', {})
  kernels = [event('loop_multiply_fusion_12', 2), event('loop_multiply_fusion_3', 3),
             event('gemv_kernel', 4), event('input_reduce_fusion.7', 1),
             event('input_reduce_fusion', 1), event('fusion.1.2', 9)]
  assert profile.kernel_kinds(kernels) == (('fusion', 1, 9.0), ('loop_multiply_fusion', 2, 5.0),
                                           ('gemv_kernel', 1, 4.0),
                                           ('input_reduce_fusion', 2, 2.0))
  assert profile.kernel_kinds(kernels, top=1) == (('fusion', 1, 9.0),)
  path_counts = profile.count_events([*kernels, event('MemcpyD2H', 50)])
  assert path_counts.kinds[0] == ('fusion', 1, 9.0)  # the copy is not a kernel kind
  record = profile._steps_record(path_counts, 2, 'draft_step')  # pylint: disable=protected-access
  assert record['kernel_kinds'][1] == {'kind': 'loop_multiply_fusion',
                                       'kernels_per_draft_step': 1.0, 'us_per_draft_step': 2.5}


def test_busy_time_is_the_union_of_intervals():
  def event(start, duration):
    return profile.Event('k', start, duration, '/device:GPU:0', 'Stream #1', {})
  busy, span = profile.busy_and_span([event(10, 5), event(0, 4), event(12, 10), event(3, 2)])
  assert (busy, span) == (5 + 12, 22)  # [0, 5] and [10, 22]
  assert profile.busy_and_span([]) == (0.0, 0.0)


def test_a_tpu_trace_counts_its_xla_ops_line(tmp_path):
  path = _write_trace(tmp_path / 'a.trace.json.gz',
                      {3: ('/device:TPU:0', {30: 'XLA Ops', 31: 'Steps'})},
                      [(3, 30, 'fusion.1', 0, 2, None), (3, 30, 'copy-start', 3, 1, None),
                       (3, 31, 'step 0', 0, 10, None)])
  counts = profile.count_events(profile.load_events(str(path)))
  assert (counts.source, counts.kernels, counts.d2h_copies) == ('device XLA ops', 2, 0)
  assert counts.span_ms == pytest.approx(0.004) and counts.busy_ms == pytest.approx(0.003)


def test_a_cpu_trace_counts_thunks_without_markers_or_containers(tmp_path):
  thunk = lambda op: {'hlo_op': op, 'hlo_module': 'jit_f'}  # noqa: E731
  path = _write_trace(tmp_path / 'vm.trace.json.gz',
                      {1: ('/host:CPU', {10: 'python', 11: 'tf_XLAPjRtCpuClient'})},
                      [(1, 10, 'PjitFunction(f)', 0, 30, None),
                       (1, 11, 'while.5', 1, 20, thunk('while.5')),
                       (1, 11, 'fusion', 2, 3, thunk('fusion')),
                       (1, 11, 'end: fusion', 5, 1, None),
                       (1, 11, 'dot.1', 8, 4, thunk('dot.1'))])
  counts = profile.count_events(profile.load_events(str(path)))
  assert (counts.source, counts.kernels, counts.host_waits) == ('XLA:CPU thunks (host)', 2, 0)
  assert counts.busy_ms == pytest.approx(0.007) and counts.span_ms == pytest.approx(0.010)
  # A trace with no operations says so rather than counting zero kernels of a device.
  empty = _write_trace(tmp_path / 'empty.trace.json.gz', {1: ('/host:CPU', {10: 'python'})},
                       [(1, 10, 'cuStreamSynchronize', 0, 1, None)])
  counts = profile.count_events(profile.load_events(str(empty)))
  assert (counts.source, counts.kernels, counts.host_waits) == (
      'no device operations traced', 0, 1)


def test_a_real_trace_counts_the_programs_operations():
  x = jnp.ones((16, 16))

  def loop(n):
    body = lambda _, v: jnp.tanh(v @ v) * 0.5 + jnp.sin(v)  # noqa: E731
    return jax.jit(lambda v: jax.lax.fori_loop(0, n, body, v))

  counts = {}
  for n in (2, 6):
    program = loop(n)
    jax.block_until_ready(program(x))  # compiled before it is traced
    counts[n] = profile.traced(lambda: program(x), module='jit')
  assert counts[2].source == 'XLA:CPU thunks (host)'
  assert 0 < counts[2].kernels < counts[6].kernels
  per_iteration = (counts[6].kernels - counts[2].kernels) / 4
  assert per_iteration == int(per_iteration) and per_iteration >= 1
  assert counts[6].d2h_copies == counts[6].host_waits == 0
  assert 0.0 <= counts[6].idle_ms <= counts[6].span_ms

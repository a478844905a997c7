"""The accelerator path, checked on the CPU: what a GPU or TPU runs is plain XLA.

- The CPU-only pieces (jaxspec.model.cpu) are inert off the CPU: with the platform
  reported as 'gpu' no decode step, draft step or attention calls an FFI kernel, even
  with T5Config.cpu_matmul = 'kernel' and float32 few-row products where the CPU uses it.
- The compiled speculative loop moves nothing to or from the host per iteration: no host
  callback, infeed, outfeed, send or recv (and no custom call at all) in its optimized
  HLO; the loop's caches are updated in place: batch > 1 by scatters, batch 1 by
  dynamic update slices into the loop state, and no copy of a cache buffer inside it (with
  fixed-width target steps, T5Config.decode_positions, too). The API
  donates nothing: every decode buffer is made inside the jitted call (no argument has
  a cache buffer's shape, the entry computation aliases no input to an output).
- The int8 self-draft decodes through plain XLA (cpu_matmul='xla'), and speculative
  decoding with it is token for token the baseline at temperature 0.
- Greedy speculative decoding is token for token the baseline in bfloat16 too.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import EOS_ID, get_config
from jaxspec.decoding import speculative
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import Int8Drafter, T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import init_params
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.sampling import SamplingConfig

ONE_LAYER = {'num_encoder_layers': 1, 'num_decoder_layers': 1}
GAMMA = 3


def _params(config, seed, eos_scale=1.0):
  """Random variables in the transposed layout (where the CPU kernel applies); the EOS
  logit scaled by eos_scale, so rows end at different lengths."""
  params = init_params(config, jax.random.PRNGKey(seed))['params']
  if eos_scale != 1.0:
    params = jax.tree_util.tree_map(lambda x: x, params)  # new containers, shared leaves
    dense = params['decoder']['logits_dense']
    dense['kernel'] = dense['kernel'].at[:, EOS_ID].multiply(eos_scale)
  return kernel_layout.transposed_kernels({'params': params})


def _encoder_tokens(batch, length=6, seed=0):
  return np.random.default_rng(seed).integers(2, 64, (batch, length)).astype(np.int32)


def _lowered_speculative_loop(target_config, drafter, target_params, drafter_params, batch,
                              max_decode_length):
  return speculative._speculative_generate.lower(  # pylint: disable=protected-access
      target_params, drafter_params, jnp.asarray(_encoder_tokens(batch)),
      jax.random.PRNGKey(0), target_config=target_config, drafter=drafter,
      spec=SpeculativeConfig(gamma=GAMMA), max_decode_length=max_decode_length,
      sampling=SamplingConfig(), eos_id=EOS_ID)


# ----------------------------------------------------------------------------------
# The CPU kernels are inert off the CPU.


def _trace_every_kernel_route(max_decode_length):
  """Lowered text of a float32 speculative loop with the int8 self-draft under
  cpu_matmul='kernel': the target's verify steps (transposed kernels, few rows), the
  draft's int8 products and both attentions take the kernel wherever it applies.
  max_decode_length keeps each call's trace its own (jit caches traces by statics)."""
  config = get_config('test_tiny_1_1', **ONE_LAYER)
  assert config.cpu_matmul == 'kernel'
  target = _params(config, 3)
  drafter = Int8Drafter(config)
  return _lowered_speculative_loop(config, drafter, target, drafter.draft_params(target), 1,
                                   max_decode_length).as_text()


def test_off_cpu_the_model_never_calls_a_kernel(monkeypatch):
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')

  def refuse(*args, **kwargs):
    raise AssertionError('an FFI kernel was called with the platform reported as gpu')

  monkeypatch.setattr(jax.ffi, 'ffi_call', refuse)
  monkeypatch.setattr(cpu_matmul, 'kernel_available', refuse)
  assert not cpu_matmul.use_kernel('kernel')
  assert cpu_matmul.kernel_status('kernel').startswith('XLA (platform gpu')
  assert kernel_layout.decode_layout() == kernel_layout.FUSED
  text = _trace_every_kernel_route(max_decode_length=11)
  assert 'custom_call' not in text


def test_on_cpu_the_same_trace_calls_the_kernels():
  """The check above has power: on the CPU the same program calls the kernels."""
  if not cpu_matmul.kernel_available():
    pytest.skip('the CPU kernel is not built here')
  text = _trace_every_kernel_route(max_decode_length=13)
  for target in (cpu_matmul.TARGET_NAME, cpu_matmul.INT8_TARGET_NAME,
                 cpu_matmul.ATTENTION_WRITE_TARGET_NAME):
    assert target in text, target


# ----------------------------------------------------------------------------------
# The compiled loop: no host transfers, caches in place.

# Opcodes that move data between host and device, and the custom-call targets of host
# callbacks (jax.pure_callback / io_callback / debug.callback on every platform).
HOST_TRANSFER_OPCODES = ('infeed', 'outfeed', 'send', 'send-done', 'recv', 'recv-done')
HOST_CALLBACK = re.compile(r'custom_call_target="[^"]*callback[^"]*"', re.IGNORECASE)


def host_transfers(hlo_text: str) -> list[str]:
  """The instructions of an optimized HLO module that involve the host."""
  found = []
  for line in hlo_text.splitlines():
    match = re.search(r'= [^=]*? ([a-z\-]+)\(', line)
    if match and match.group(1) in HOST_TRANSFER_OPCODES:
      found.append(line.strip())
    elif HOST_CALLBACK.search(line):
      found.append(line.strip())
  return found


def computations(hlo_text: str) -> tuple[str, dict[str, list[str]]]:
  """(entry name, {computation name: its instruction lines}) of an HLO module's text."""
  found, entry, name, lines = {}, None, None, []
  for line in hlo_text.splitlines():
    header = re.match(r'^(ENTRY )?%?([\w.\-]+) .*\{$', line)
    if header:
      name, lines = header.group(2), []
      if header.group(1):
        entry = name
    elif line.startswith('}') and name is not None:
      found[name], name = lines, None
    elif name is not None:
      lines.append(line)
  return entry, found


_CALLS_ONE = re.compile(r'\b(?:calls|body|condition|to_apply|true_computation|'
                       r'false_computation)=%?([\w.\-]+)')
_CALLS_MANY = re.compile(r'\b(?:branch_computations|called_computations|calls)=\{([^}]*)\}')


def _called(line: str) -> list[str]:
  names = _CALLS_ONE.findall(line)
  for group in _CALLS_MANY.findall(line):
    names += [name.strip().lstrip('%') for name in group.split(',') if name.strip()]
  return names


def reachable(found: dict[str, list[str]], root: str) -> set[str]:
  """The computations `root` runs, itself included (fusions, branches, nested loops)."""
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name in seen or name not in found:
      continue
    seen.add(name)
    for line in found[name]:
      todo.extend(_called(line))
  return seen


def _loop_body(hlo_text):
  """(computations, the set the speculative while loop's body runs): the entry's while
  loop whose state holds the most cache buffers is the decode loop."""
  entry, found = computations(hlo_text)
  loops = [line for line in found[entry] if re.search(r' while\(', line)]
  assert loops, 'no while loop in the entry computation'
  loop = max(loops, key=len)
  body = re.search(r'body=%?([\w.\-]+)', loop).group(1)
  return found, reachable(found, body)


def _cache_shape(config, batch, max_decode_length):
  dtype = {'float32': 'f32', 'bfloat16': 'bf16'}[config.dtype]
  length = max_decode_length + GAMMA  # the target's and the draft's buffers alike
  return f'{dtype}[{batch},{config.num_heads},{config.head_dim},{length}]'


def _whole_buffer_copies(found, body, shape):
  pattern = re.compile(r'= ' + re.escape(shape) + r'(\{[^}]*\})? copy\(')
  return [line.strip() for name in body for line in found[name] if pattern.search(line)]


@functools.cache
def _compiled_loop(batch, decode_positions=0):
  """Optimized HLO of the speculative loop through plain XLA (cpu_matmul='xla'), a T5
  draft, greedy, the target's steps of decode_positions: (text, target config,
  max_decode_length)."""
  target = get_config('test_tiny_1_1', cpu_matmul='xla', decode_positions=decode_positions,
                      **ONE_LAYER)
  draft = get_config('test_tiny_1_0', cpu_matmul='xla', **ONE_LAYER)
  lowered = _lowered_speculative_loop(target, T5Drafter(draft), _params(target, 0),
                                      _params(draft, 1), batch, 16)
  return lowered.compile().as_text(), target, 16


def test_host_transfer_check_finds_a_callback_in_a_loop():
  def body(x):
    jax.debug.callback(lambda v: None, x)
    return x + 1
  text = jax.jit(lambda x: jax.lax.while_loop(lambda v: v < 3, body, x)).lower(
      jnp.int32(0)).compile().as_text()
  assert host_transfers(text)


@pytest.mark.parametrize('batch', [1, 2])
def test_the_compiled_loop_moves_nothing_through_the_host(batch):
  text, _, _ = _compiled_loop(batch)
  assert host_transfers(text) == []
  assert 'custom-call' not in text  # plain XLA: nothing an accelerator would lack
  # Nothing is donated, and nothing need be: no argument is a decode buffer.
  assert 'input_output_alias' not in text.splitlines()[0]


def test_the_loop_state_holds_the_caches_made_inside_the_call():
  text, config, max_decode_length = _compiled_loop(2)
  header = text.splitlines()[0]
  parameters = re.search(r'entry_computation_layout=\{\((.*?)\)->', header).group(1)
  shape = _cache_shape(config, 2, max_decode_length)
  assert shape not in parameters  # no decode buffer comes in: nothing to donate
  found, body = _loop_body(text)
  state = [line for name in body for line in found[name] if shape in line]
  assert state, 'the decode loop carries no cache buffer'


# Fixed-width steps (T5Config.decode_positions) attend over copies of the buffers with
# the step's keys in their slots and still write the buffers in place.
@pytest.mark.parametrize('decode_positions', [0, GAMMA + 1])
def test_batched_caches_are_scattered_in_place_inside_the_loop(decode_positions):
  text, config, max_decode_length = _compiled_loop(2, decode_positions)
  found, body = _loop_body(text)
  shape = _cache_shape(config, 2, max_decode_length)
  # A scatter, or the loop of dynamic-update-slices XLA expands it into on the CPU.
  writes = [line for name in body for line in found[name]
            if re.search(re.escape(shape) + r'(\{[^}]*\})? (scatter|dynamic-update-slice)\(',
                         line)]
  assert writes  # every decode step writes its keys/values into the loop's buffers
  assert _whole_buffer_copies(found, body, shape) == []


@pytest.mark.parametrize('decode_positions', [0, GAMMA + 1])
def test_single_row_caches_update_in_place_inside_the_loop(decode_positions):
  text, config, max_decode_length = _compiled_loop(1, decode_positions)
  found, body = _loop_body(text)
  shape = _cache_shape(config, 1, max_decode_length)
  in_place = [line for name in body for line in found[name]
              if re.search(re.escape(shape) + r'(\{[^}]*\})? dynamic-update-slice\(%param',
                           line)]
  assert in_place  # the slice is written into the operand's buffer ...
  assert _whole_buffer_copies(found, body, shape) == []  # ... and never copied whole


# ----------------------------------------------------------------------------------
# The int8 self-draft through plain XLA, and bfloat16 exactness.


def test_int8_draft_through_xla_is_the_baseline_greedy():
  config = get_config('test_tiny_1_1', cpu_matmul='xla', **ONE_LAYER)
  target = _params(config, 3, eos_scale=2.5)
  drafter = Int8Drafter(config)
  draft_params = drafter.draft_params(target)
  tokens = _encoder_tokens(4, 9, seed=5)
  lowered = speculative._speculative_generate.lower(  # pylint: disable=protected-access
      target, draft_params, jnp.asarray(tokens), jax.random.PRNGKey(0), target_config=config,
      drafter=drafter, spec=SpeculativeConfig(gamma=GAMMA), max_decode_length=12,
      sampling=SamplingConfig(), eos_id=EOS_ID)
  assert 'custom_call' not in lowered.as_text()  # the int8 products are XLA's
  baseline = generate(target, tokens, config=config, max_decode_length=12)
  result = speculative_generate(target, draft_params, tokens, target_config=config,
                                drafter=drafter, spec=SpeculativeConfig(gamma=GAMMA),
                                max_decode_length=12)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  assert len(set(np.asarray(baseline.lengths).tolist())) > 1  # rows end apart
  assert float(result.stats.alpha) > 0.8  # the target's own decoder, int8


def test_greedy_speculative_is_the_baseline_in_bfloat16():
  dtypes = dict(dtype='bfloat16', param_dtype='bfloat16', cpu_matmul='xla')
  target_config = get_config('test_tiny_1_1', **dtypes, **ONE_LAYER)
  draft_config = get_config('test_tiny_1_0', **dtypes, **ONE_LAYER)
  target = _params(target_config, 2, eos_scale=2.5)
  draft = _params(draft_config, 1)
  assert {x.dtype for x in jax.tree_util.tree_leaves(target)} == {jnp.dtype('bfloat16')}
  tokens = _encoder_tokens(4, 9, seed=7)
  baseline = generate(target, tokens, config=target_config, max_decode_length=14)
  for drafter, params in ((T5Drafter(draft_config), draft),  # a different model
                          (T5Drafter(target_config), target)):  # itself: every draft accepted
    result = speculative_generate(target, params, tokens, target_config=target_config,
                                  drafter=drafter, spec=SpeculativeConfig(gamma=GAMMA),
                                  max_decode_length=14)
    np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  assert float(result.stats.alpha) == 1.0
  assert len(set(np.asarray(baseline.lengths).tolist())) > 1

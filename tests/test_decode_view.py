"""The view of a decode (jaxspec/measure/decode_view.py): steps from a trace, terminal and HTML.

A hand-made trace covers every case (a rejection, a full accept, a row that drafted
fewer than gamma, EOS inside the accepted drafts, a finished row); a real sampled decode
checks that the steps rebuild its output and that the parsed HTML holds exactly the
steps' marked spans.
"""

import html.parser
import re
import types

import jax
import numpy as np

from jaxspec.measure import decode_view
from jaxspec.config import EOS_ID, get_config
from jaxspec.decoding.drafters import T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import init_params
from jaxspec.sampling import SamplingConfig


def _trace(**fields):
  """A one-row trace from lists per iteration."""
  return types.SimpleNamespace(**{k: np.asarray([v]) for k, v in fields.items()})


def test_steps_mark_every_case():
  trace = _trace(
      # iteration:  0 first   1 reject at 1   2 full accept  3 k=2 of 3    4 EOS cut   5 done
      drafts=[[0, 0, 0], [5, 6, 7], [8, 9, 10], [11, 12, 13], [14, EOS_ID, 15], [3, 3, 3]],
      num_drafts=[0, 3, 3, 2, 3, 3],
      num_accepted=[0, 1, 3, 2, 3, 0],
      next_token=[4, 20, 21, 22, 23, 0],
      committed=[1, 2, 4, 3, 2, 0])
  steps = decode_view.decode_steps(trace, 0)
  kinds = [[(s.token, s.kind) for s in step.spans] for step in steps]
  assert kinds == [
      [(4, 'bonus')],
      [(5, 'accepted'), (6, 'rejected'), (7, 'rejected'), (20, 'corrected')],
      [(8, 'accepted'), (9, 'accepted'), (10, 'accepted'), (21, 'bonus')],
      [(11, 'accepted'), (12, 'accepted'), (22, 'bonus')],  # Draft 13 was never proposed.
      [(14, 'accepted'), (EOS_ID, 'accepted')],  # Cut at EOS: 15 and 23 never output.
  ]
  assert decode_view.output_tokens(steps) == [4, 5, 20, 8, 9, 10, 21, 11, 12, 22, 14, EOS_ID]
  assert decode_view.summary(steps) == {
      'accepted': 8, 'rejected': 2, 'corrected': 1, 'bonus': 3, 'target_calls': 5,
      'output_tokens': 12, 'tokens_per_target_call': 2.4}


def _fake_decode(ids):
  """Word-like pieces: token t is ' w<t>', and 7 is '<&>' to test escaping."""
  return ''.join('<&>' if t == 7 else f' w{t}' for t in ids if t != EOS_ID).lstrip()


class _SpanParser(html.parser.HTMLParser):
  """Collects [(data-iteration, [(kind, data-token, text)])] from the steps list."""

  def __init__(self):
    super().__init__()
    self.steps, self._span, self.tags = [], None, set()

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    self.tags.add(tag)
    if tag == 'li':
      self.steps.append((int(attrs['data-iteration']), []))
    elif tag == 'span' and 'data-token' in attrs:
      kind = attrs['class'].split()[1]
      self._span = [kind, int(attrs['data-token']), '']
    for name in ('src', 'href'):
      assert name not in attrs, f'external resource in <{tag}>'

  def handle_data(self, data):
    if self._span is not None:
      self._span[2] += data

  def handle_endtag(self, tag):
    if tag == 'span' and self._span is not None:
      self.steps[-1][1].append(tuple(self._span))
      self._span = None


def _real_decode():
  target, draft = get_config('test_tiny_1_1'), get_config('test_tiny_1_0')
  encoder_tokens = np.array([[5, 9, 7, 12, 3, 1], [8, 7, 6, 1, 0, 0]], np.int32)
  return speculative_generate(
      init_params(target, jax.random.PRNGKey(2)), init_params(draft, jax.random.PRNGKey(1)),
      encoder_tokens, jax.random.PRNGKey(3), target_config=target, drafter=T5Drafter(draft),
      spec=SpeculativeConfig(gamma=2, verification='block'), max_decode_length=12,
      sampling=SamplingConfig(temperature=1.0), record_trace=True)


def test_views_of_a_real_decode_hold_the_traced_spans():
  result = _real_decode()
  kinds_seen = set()
  for row in range(2):
    steps = decode_view.decode_steps(result.trace, row)
    length = int(result.output.lengths[row])
    assert decode_view.output_tokens(steps) == np.asarray(result.output.tokens[row, :length]).tolist()
    assert len(steps) == int(result.stats.row_target_calls[row])
    texts = decode_view.token_texts(steps, _fake_decode)
    page = decode_view.to_html(steps, texts, title=f'row {row}', input_text='a <b> & c',
                               output_text=_fake_decode(decode_view.output_tokens(steps)),
                               stats=decode_view.summary(steps))
    parser = _SpanParser()
    parser.feed(page)
    parser.close()
    assert parser.steps == [
        (step.iteration, [(s.kind, s.token, text) for s, text in zip(step.spans, step_texts)])
        for step, step_texts in zip(steps, texts)]
    assert 'script' not in parser.tags and 'a <b> & c' not in page  # Escaped, no scripts.
    terminal = decode_view.to_terminal(steps, texts)
    lines = terminal.splitlines()[:-1]  # The last line is the legend.
    assert len(lines) == len(steps)
    for line, step, step_texts in zip(lines, steps, texts):
      codes = re.findall(r'\x1b\[([0-9;]+)m', line)
      assert codes[0::2] == [decode_view._ANSI[s.kind] for s in step.spans]
      assert re.sub(r'\x1b\[[0-9;]+m', '', line) == f'{step.iteration:4d} | ' + ''.join(step_texts)
    kinds_seen |= {s.kind for step in steps for s in step.spans}
  assert kinds_seen == set(decode_view.KINDS)

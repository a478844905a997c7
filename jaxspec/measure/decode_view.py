"""A view of one speculative decode (the paper's Figure 1): every iteration's drafts
marked accepted, rejected, corrected or bonus, for a terminal (ANSI colours) or as a
self-contained HTML page.

Input is one row of a SpeculativeTrace (speculative_generate(..., record_trace=True)).
Per iteration: the accepted drafts, then the drafts the target rejected (the first
rejected one and the drafts after it, all discarded), then the target's token: the
correction drawn from the residual after a rejection, or the bonus token after a fully
accepted proposal. Iteration 0 is the first proposal, after the start token alone
(the target draws no token without drafts). Tokens cut by EOS or the length limit were never output and are
left out, so the accepted, corrected and bonus tokens in order are the output.
Nothing here runs a model; scripts/show.py and scripts/infer.py (infer.view_examples)
render real decodes.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Callable, Sequence

import numpy as np

KINDS = ('accepted', 'rejected', 'corrected', 'bonus')
OUTPUT_KINDS = ('accepted', 'corrected', 'bonus')  # The kinds that are output tokens.

# ANSI SGR codes per kind: green, red struck through, blue, magenta (paper Figure 1:
# accepted green, rejected red, corrections blue).
_ANSI = {'accepted': '32', 'rejected': '31;9', 'corrected': '34;1', 'bonus': '35;1'}
_CSS = """
body { font-family: sans-serif; max-width: 60em; margin: 2em auto; line-height: 1.6; }
ol.steps { font-family: monospace; }
ol.steps li { white-space: pre-wrap; }
.token { padding: 0 1px; border-radius: 3px; }
.accepted { background: #d4f5d4; color: #135e13; }
.rejected { background: #fadada; color: #9b1c1c; text-decoration: line-through; }
.corrected { background: #d6e4fb; color: #1d3f8f; font-weight: bold; }
.bonus { background: #efdcf7; color: #6b1d8f; font-weight: bold; }
.text { font-family: monospace; white-space: pre-wrap; background: #f4f4f4; padding: .5em; }
"""


@dataclasses.dataclass(frozen=True)
class Span:
  token: int
  kind: str  # One of KINDS.


@dataclasses.dataclass(frozen=True)
class Step:
  iteration: int  # 0 is the first proposal (after the start token alone).
  spans: tuple[Span, ...]


def decode_steps(trace, row: int) -> list[Step]:
  """The steps of `row` from a SpeculativeTrace (arrays with a batch axis), in order,
  up to the last iteration that committed a token."""
  drafts = np.asarray(trace.drafts[row])  # [L, g]
  num_drafts, num_accepted, next_token, committed = (
      np.asarray(x[row]) for x in (trace.num_drafts, trace.num_accepted, trace.next_token,
                                   trace.committed))
  steps = []
  for iteration in range(len(committed)):
    count = int(committed[iteration])
    if count == 0:  # The row was done (or stopped) before this iteration.
      break
    accepted, drafted = int(num_accepted[iteration]), int(num_drafts[iteration])
    spans = [Span(int(t), 'accepted') for t in drafts[iteration, :min(accepted, count)]]
    spans += [Span(int(t), 'rejected') for t in drafts[iteration, accepted:drafted]]
    if count > accepted:
      spans.append(Span(int(next_token[iteration]),
                        'corrected' if accepted < drafted else 'bonus'))
    steps.append(Step(iteration, tuple(spans)))
  return steps


def output_tokens(steps: Sequence[Step]) -> list[int]:
  """The output tokens the steps committed: their accepted, corrected and bonus spans."""
  return [s.token for step in steps for s in step.spans if s.kind in OUTPUT_KINDS]


def token_texts(steps: Sequence[Step], decode: Callable[[Sequence[int]], str],
                eos_id: int = 1) -> list[list[str]]:
  """Display text of every span: what it adds to the text of the output before it.

  decode(ids) -> text (a vocabulary's decode). Decoding the token in context keeps the
  spaces of SentencePiece-style pieces; where that is not a plain extension of the
  context's text, the token is decoded alone. EOS shows as '</s>'.
  """
  context, texts = [], []
  for step in steps:
    step_texts = []
    base = decode(context)
    for span in step.spans:
      if span.token == eos_id:
        text = '</s>'
      else:
        extended = decode(context + [span.token])
        text = extended[len(base):] if extended.startswith(base) else decode([span.token])
      step_texts.append(text)
      if span.kind == 'accepted':
        context = context + [span.token]
        base = decode(context)
    texts.append(step_texts)
    context = context + [s.token for s in step.spans if s.kind in ('corrected', 'bonus')]
  return texts


def to_terminal(steps: Sequence[Step], texts: Sequence[Sequence[str]]) -> str:
  """One line per iteration, spans coloured with ANSI codes, then a legend."""
  lines = []
  for step, step_texts in zip(steps, texts):
    cells = ''.join(f'\x1b[{_ANSI[s.kind]}m{text}\x1b[0m'
                    for s, text in zip(step.spans, step_texts))
    lines.append(f'{step.iteration:4d} | {cells}')
  legend = '  '.join(f'\x1b[{_ANSI[kind]}m{kind}\x1b[0m' for kind in KINDS)
  return '\n'.join(lines + [f'       {legend}'])


def to_html(steps: Sequence[Step], texts: Sequence[Sequence[str]], *, title: str,
            input_text: str = '', output_text: str = '', stats: dict | None = None) -> str:
  """A self-contained HTML page (inline CSS, no scripts): one list item per iteration,
  each token a <span class="token KIND" data-token="ID">."""
  escape = html.escape
  items = []
  for step, step_texts in zip(steps, texts):
    spans = ''.join(
        f'<span class="token {s.kind}" data-token="{s.token}" title="{s.kind} {s.token}">'
        f'{escape(text)}</span>' for s, text in zip(step.spans, step_texts))
    items.append(f'<li value="{step.iteration}" data-iteration="{step.iteration}">{spans}</li>')
  legend = ' '.join(f'<span class="token {kind}">{kind}</span>' for kind in KINDS)
  stats_rows = ''.join(f'<tr><th>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>'
                       for k, v in (stats or {}).items())
  return (
      '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
      f'<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n'
      f'<h1>{escape(title)}</h1>\n'
      f'<h2>Input</h2><p class="text input">{escape(input_text)}</p>\n'
      f'<h2>Iterations</h2><p class="legend">{legend}</p>\n'
      f'<ol class="steps" start="0">\n' + '\n'.join(items) + '\n</ol>\n'
      f'<h2>Output</h2><p class="text output">{escape(output_text)}</p>\n'
      + (f'<table class="stats">{stats_rows}</table>\n' if stats_rows else '')
      + '</body></html>\n')


def summary(steps: Sequence[Step]) -> dict:
  """Counts of each kind, target calls and tokens per target call of the decode."""
  counts = {kind: sum(s.kind == kind for step in steps for s in step.spans) for kind in KINDS}
  tokens = len(output_tokens(steps))
  return {**counts, 'target_calls': len(steps), 'output_tokens': tokens,
          'tokens_per_target_call': round(tokens / max(len(steps), 1), 3)}


def render_row(trace, row: int, decode: Callable[[Sequence[int]], str], *, title: str,
               input_text: str = '', eos_id: int = 1) -> tuple[str, str]:
  """(terminal text, HTML page) of one row of a SpeculativeTrace; decode(ids) -> text."""
  steps = decode_steps(trace, row)
  texts = token_texts(steps, decode, eos_id)
  page = to_html(steps, texts, title=title, input_text=input_text,
                 output_text=decode(output_tokens(steps)), stats=summary(steps))
  return to_terminal(steps, texts), page

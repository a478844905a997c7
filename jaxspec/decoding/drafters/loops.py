"""How a proposal runs its draft steps: with an early exit, or with a trip count XLA sees.

A cached-decoder drafter drafts one token a decode step, up to gamma a proposal, and a
row stops drafting at its first drafted EOS (or an adaptive stop). Two loop forms give
the same drafts bit for bit (DraftContext.draft_loop, SpeculativeConfig.draft_loop):

  'early_exit'  a lax.while_loop that ends once every row has stopped. On the CPU the
                loop's condition is read where the program runs, so a proposal whose
                rows all stop early costs only the steps it took.
  'static'      the steps run under a lax.fori_loop with Python-int bounds: XLA sees the
                trip count. A step that starts after every row has stopped still runs
                and its drafts are discarded (the early-exit loop never ran it). XLA:GPU
                runs a while loop whose trip count it cannot see by copying the condition
                to the host and waiting for the stream at every iteration; with a known
                trip count it enqueues the steps without waiting.
  'auto'        'early_exit' where the program is lowered for the CPU, 'static'
                elsewhere (lax.platform_dependent: both are traced, the lowering keeps
                the one of the platform it compiles for, so a program exported from a
                CPU for a TPU takes the TPU's form).

Inside a step the rows that have stopped are masked as before (cpu_matmul.active_rows:
on the CPU their products are skipped).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

AUTO, EARLY_EXIT, STATIC = 'auto', 'early_exit', 'static'
DRAFT_LOOPS = (AUTO, EARLY_EXIT, STATIC)
# Platforms whose 'auto' form is the early exit (lax.platform_dependent's names).
EARLY_EXIT_PLATFORMS = ('cpu',)


def check_draft_loop(setting: str, name: str = 'draft_loop') -> str:
  if setting not in DRAFT_LOOPS:
    raise ValueError(f'{name} must be one of {DRAFT_LOOPS} (how a proposal loops over its '
                     f'draft steps), got {setting!r}')
  return setting


def draft_loop_for(platform: str, setting: str = AUTO) -> str:
  """The loop form `setting` runs on `platform` ('cpu', 'gpu', 'cuda', 'rocm', 'tpu'):
  'early_exit' or 'static'."""
  check_draft_loop(setting)
  if setting != AUTO:
    return setting
  return EARLY_EXIT if platform in EARLY_EXIT_PLATFORMS else STATIC


def run_draft_steps(form: str, first: int, stop: int, running: Callable[[Any], jax.Array],
                    step: Callable[[Any, Any, Any], Any], carry):
  """Runs carry = step(i, carry, live) for i = first .. stop - 1 (Python ints) in the
  loop `form` (DRAFT_LOOPS) -> the final carry.

  running(carry) -> [] bool: some row still drafts. 'early_exit' stops once it is False,
  and every step it runs gets live=True (a Python bool). 'static' runs every step with
  live = running(carry) at the step's start (a traced bool): a step with live False must
  leave the carry's values as the early exit leaves them (its drafts discarded); what it
  writes past every row's stop (cache slots a later step rewrites before reading) may
  differ.
  """
  check_draft_loop(form)
  early = functools.partial(_early_exit, first, stop, running, step)
  static = functools.partial(_static, first, stop, running, step)
  if form == EARLY_EXIT:
    return early(carry)
  if form == STATIC:
    return static(carry)
  return jax.lax.platform_dependent(
      carry, default=static, **{platform: early for platform in EARLY_EXIT_PLATFORMS})


def _early_exit(first, stop, running, step, carry):
  def unfinished(indexed):
    i, carry = indexed
    return (i < stop) & running(carry)

  def body(indexed):
    i, carry = indexed
    return i + 1, step(i, carry, True)

  return jax.lax.while_loop(unfinished, body, (jnp.int32(first), carry))[1]


def _static(first, stop, running, step, carry):
  return jax.lax.fori_loop(first, stop, lambda i, c: step(i, c, running(c)), carry)


def kept(live, value, discarded=0):
  """value where the step is live (a Python True: value itself, no operation), else
  `discarded` (what the early-exit loop leaves there)."""
  if live is True or value is None:
    return value
  return jnp.where(live, value, discarded)

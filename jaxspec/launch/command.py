"""The one wrapper around every jaxspec-* command (pyproject.toml's [project.scripts]
and scripts/*.py run each launcher's `cli`, made here from its `main`).

A user error (jaxspec.errors.UserError: a setting, a file, an input, a checkpoint, a
busy output directory) ends the command with one line on stderr,

    jaxspec-infer: error: gamma must be >= 1, got -1

and exit status 2, as argparse ends on a bad flag; with --verbose its traceback comes
first. Ctrl-C ends it with `jaxspec-<cmd>: interrupted` and status 130. Any other
exception is a bug and is raised with its traceback, as Python does.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable

from jaxspec import errors

VERBOSE_FLAG = '--verbose'
USER_ERROR_STATUS = 2  # as argparse's errors
INTERRUPTED_STATUS = 130  # as a shell reports SIGINT


def add_verbose_flag(parser: argparse.ArgumentParser):
  """The --verbose flag every command takes (run() reads it from sys.argv)."""
  parser.add_argument(VERBOSE_FLAG, action='store_true',
                      help='show the traceback of an error (user errors are one line '
                      'without it)')


def one_line(error: BaseException) -> str:
  """The error's message on one line, without gin's "In call to configurable" notes."""
  lines = [line.strip() for line in str(error).splitlines()]
  kept = [line for line in lines if line and not line.startswith('In call to configurable')]
  return ' '.join(kept) or type(error).__name__


def run(main: Callable[[], object]) -> int:
  """Runs `main()` (which reads sys.argv) as the command named by sys.argv[0]; returns
  the exit status: main's own where it returns an int, 0 when it returns anything
  else, 2 after a user error, 130 after Ctrl-C."""
  program = os.path.basename(sys.argv[0]) or 'jaxspec'
  verbose = VERBOSE_FLAG in sys.argv[1:]
  try:
    status = main()
  except errors.UserError as error:
    if verbose:
      traceback.print_exc()
    sys.stdout.flush()  # What the run printed comes before the error line.
    print(f'{program}: error: {one_line(error)}', file=sys.stderr)
    return USER_ERROR_STATUS
  except KeyboardInterrupt:
    if verbose:
      traceback.print_exc()
    sys.stdout.flush()
    print(f'{program}: interrupted', file=sys.stderr)
    return INTERRUPTED_STATUS
  return status if isinstance(status, int) and not isinstance(status, bool) else 0


def entry_point(main: Callable[[], object]) -> Callable[[], int]:
  """The console entry point of a launcher's `main`: `run(main)`."""

  def cli() -> int:
    return run(main)

  cli.__doc__ = f'The command line of {main.__module__}.main (jaxspec.launch.command.run).'
  return cli

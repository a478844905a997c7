"""T5X-style gin flags: --gin_file (repeatable), --gin.NAME=VALUE, --gin_bindings,
--gin_search_paths. Shared by the scripts in this directory."""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import re

import gin

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_UNKNOWN_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'")


def rewrite_gin_args(argv: list[str]) -> list[str]:
  """Turns --gin.NAME=VALUE into --gin_bindings=NAME=VALUE, as t5x does."""
  rewritten = []
  for arg in argv:
    if arg.startswith('--gin.'):
      name, _, value = arg[len('--gin.'):].partition('=')
      rewritten.append(f'--gin_bindings={name} = {value}')
    else:
      rewritten.append(arg)
  return rewritten


def parse(argv: list[str], description: str = '') -> argparse.Namespace:
  """Parses gin flags (plus any others the caller adds later) and applies them."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--gin_file', action='append', default=[])
  parser.add_argument('--gin_bindings', action='append', default=[])
  parser.add_argument('--gin_search_paths', default=REPO_ROOT)
  args = parser.parse_args(rewrite_gin_args(argv))
  for path in args.gin_search_paths.split(','):
    if path:
      gin.add_config_file_search_path(path)
  try:
    gin.parse_config_files_and_bindings(args.gin_file, args.gin_bindings)
  except ValueError as error:  # gin names the binding, file and line; add the fix.
    hint = parameter_hint(str(error))
    if not hint:
      raise
    raise ValueError(f'{error}\n  {hint}') from error
  return args


def parameter_hint(message: str) -> str:
  """For gin's unknown-parameter error: the closest parameter names, or all of them."""
  match = _UNKNOWN_PARAMETER.search(message)
  if match is None:
    return ''
  try:  # gin has no public way to list a configurable's parameters.
    configurable = gin.config._REGISTRY.get_match(match.group(1))
    names = list(inspect.signature(configurable.wrapped).parameters)
  except Exception:  # A private API: any failure just means no hint.
    return ''
  close = difflib.get_close_matches(match.group(2), names, n=3)
  if close:
    return f'Did you mean {" or ".join(map(repr, close))}?'
  return f'{match.group(1)} takes: {", ".join(names)}'

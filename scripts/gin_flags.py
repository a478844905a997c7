"""T5X-style gin flags: --gin_file (repeatable), --gin.NAME=VALUE, --gin_bindings,
--gin_search_paths. Shared by the scripts in this directory."""

from __future__ import annotations

import argparse
import os

import gin

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  gin.parse_config_files_and_bindings(args.gin_file, args.gin_bindings)
  return args

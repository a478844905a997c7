"""T5X-style gin flags: --gin_file (repeatable), --gin.NAME=VALUE, --gin_bindings,
--gin_search_paths; --data_dir / --checkpoint_dir, where the shipped data and
checkpoints are (jaxspec.paths); --verbose (jaxspec.launch.command). Shared by every
launcher."""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import re
import tokenize
from typing import Sequence

import gin

from jaxspec import errors, paths
from jaxspec.launch import command

# gin/ and configs/: the checkout's, or the wheel's copy inside the package.
GIN_ROOT = str(paths.gin_root())
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


def _add_gin_flags(parser: argparse.ArgumentParser):
  parser.add_argument('--gin_file', action='append', default=[],
                      help='a gin file: a whole run from configs/, or a fragment from gin/ '
                      '(repeatable; later files override earlier ones)')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help="'NAME = VALUE' (repeatable); --gin.NAME=VALUE is the same")
  parser.add_argument('--gin_search_paths', default=GIN_ROOT,
                      help='comma-separated directories searched for gin files and includes')


def parse(argv: list[str], description: str = '', add_flags=None) -> argparse.Namespace:
  """Parses gin flags, plus those add_flags(parser) adds, and applies the gin ones.

  Refuses a macro bound by a flag (--gin.NAME=VALUE) that no configuration uses: it
  would change nothing, and is most likely a typo of one that is used. What the user
  got wrong (a missing gin file, an unknown parameter, a typo) raises a
  jaxspec.errors.UserError.
  """
  parser = argparse.ArgumentParser(description=description)
  _add_gin_flags(parser)
  parser.add_argument('--data_dir', default=None,
                      help=f'the shipped corpora (default ${paths.DATA_DIR_ENV}, else data/ '
                      'of the working directory or of the checkout jaxspec runs from)')
  parser.add_argument('--checkpoint_dir', default=None,
                      help=f'the shipped checkpoints (default ${paths.CHECKPOINT_DIR_ENV}, '
                      'else checkpoints/ of the working directory or of the checkout)')
  command.add_verbose_flag(parser)
  if add_flags:
    add_flags(parser)
  args = parser.parse_args(rewrite_gin_args(argv))
  for flag, variable in ((args.data_dir, paths.DATA_DIR_ENV),
                         (args.checkpoint_dir, paths.CHECKPOINT_DIR_ENV)):
    if flag:
      os.environ[variable] = os.path.abspath(flag)
  parse_gin(args.gin_file, args.gin_bindings, args.gin_search_paths)
  return args


def read_gin_files_by_path_only():
  """Leaves gin only its reader of files by path. gin also reads 'package/file.gin' from
  Python packages on sys.path, trying it for every include the working directory lacks:
  it logged an ERROR line for each ('Path not found: gin/models/...') when a command ran
  outside a checkout, and failed with a TypeError where a checkout on sys.path made
  configs/ a namespace package. jaxspec's gin files are found by path."""
  try:  # gin has no public way to unregister a reader.
    from gin import resource_reader  # pylint: disable=g-import-not-at-top
    readers = gin.config._FILE_READERS  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    return
  readers[:] = [entry for entry in readers if entry[0] is not resource_reader.system_path_reader]


def parse_gin(gin_files: Sequence[str], bindings: Sequence[str], search_paths: str):
  """Finds the gin files (jaxspec.errors.MissingFile naming where it looked), parses
  them and the bindings, and checks the macros the bindings bind."""
  read_gin_files_by_path_only()
  search = [path for path in search_paths.split(',') if path]
  for path in search:
    gin.add_config_file_search_path(path)
  files = [find_gin_file(gin_file, search) for gin_file in gin_files]
  with errors.user_input():
    try:
      gin.parse_config_files_and_bindings(files, bindings)
    except ValueError as error:  # gin names the binding, file and line; add the fix.
      hint = parameter_hint(str(error)) or configurable_hint(str(error))
      if not hint:
        raise
      raise errors.InvalidSetting(f'{error}\n  {hint}') from error
    except (SyntaxError, tokenize.TokenError) as error:  # gin's parser, on what it read.
      raise errors.InvalidSetting(f'the gin files and bindings do not parse: {error}') from error
  check_bound_macros(bound_macros(bindings))


def find_gin_file(gin_file: str, search_paths: Sequence[str]) -> str:
  """The path of --gin_file `gin_file`: as given where it exists (from the working
  directory), else under the first search path holding it (the shipped configs/ and
  gin/ are found from any directory)."""
  if os.path.isfile(gin_file):
    return gin_file
  if not os.path.isabs(gin_file):
    for directory in search_paths:
      candidate = os.path.join(directory, gin_file)
      if os.path.isfile(candidate):
        return candidate
  shipped = (f' The shipped configs are in {os.path.join(GIN_ROOT, "configs")}.'
             if gin_file.startswith('configs') else '')
  raise errors.MissingFile(
      f'--gin_file {gin_file}: no such file in the working directory'
      + ('' if os.path.isabs(gin_file) else f' nor in {", ".join(search_paths)}') + '.'
      + shipped)


_MACRO_BINDING = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=')


def bound_macros(bindings: list[str]) -> list[str]:
  """Names of the macros that --gin_bindings lines bind (NAME = VALUE, no dot)."""
  return [match.group(1) for binding in bindings for line in binding.splitlines()
          if (match := _MACRO_BINDING.match(line))]


def used_macros() -> set[str]:
  """Macros some binding of the parsed configuration refers to (%NAME)."""
  used = set()

  def visit(value):
    if isinstance(value, gin.config.ConfigurableReference):
      scope, _, selector = value.scoped_selector.rpartition('/')
      if selector.endswith('macro') and scope:
        used.add(scope)
    elif isinstance(value, (list, tuple, set)):
      for item in value:
        visit(item)
    elif isinstance(value, dict):
      for item in value.values():
        visit(item)

  # gin has no public listing of the parsed bindings.
  for parameters in gin.config._CONFIG.values():  # pylint: disable=protected-access
    for value in parameters.values():
      visit(value)
  return used


def check_bound_macros(names: list[str]):
  """Raises jaxspec.errors.InvalidSetting (a ValueError) for a macro bound by a flag
  that no configuration uses."""
  used = used_macros()
  for name in names:
    if name in used:
      continue
    close = difflib.get_close_matches(name, sorted(used), n=3, cutoff=0.6)
    close += [m for m in sorted(used) if m.lower() == name.lower() and m not in close]
    hint = (f'Did you mean {" or ".join(map(repr, close))}?' if close
            else f'Macros in use: {", ".join(sorted(used)) or "none"}.')
    raise errors.InvalidSetting(
        f'--gin.{name} binds the macro {name}, which no configuration uses (%{name} appears '
        f'nowhere), so it would change nothing. {hint}')


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


_UNKNOWN_CONFIGURABLE = re.compile(r"No configurable matching '([^']+)'")


def configurable_hint(message: str) -> str:
  """For gin's unknown-configurable error: the closest registered names."""
  match = _UNKNOWN_CONFIGURABLE.search(message)
  if match is None:
    return ''
  try:  # A private API: any failure just means no hint.
    registry = gin.config._REGISTRY  # pylint: disable=protected-access
    names = {name for selector, _ in registry.items()
             for name in (selector, selector.rpartition('.')[2])}
  except Exception:
    return ''
  close = difflib.get_close_matches(match.group(1), sorted(names), n=3)
  return f'Did you mean {" or ".join(map(repr, close))}?' if close else ''


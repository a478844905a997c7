"""T5X-style gin flags: --gin_file (repeatable), --gin.NAME=VALUE, --gin_bindings,
--gin_search_paths; --data_dir / --checkpoint_dir, where the shipped data and
checkpoints are (jaxspec.paths); --verbose (jaxspec.launch.command); and, for a command
that names them, its main settings in --help and its shipped configs in --list_configs.
Shared by every launcher."""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import re
import tokenize
from typing import NamedTuple, Sequence

import gin

from jaxspec import errors, paths
from jaxspec.launch import command

# gin/ and configs/: the checkout's, or the wheel's copy inside the package.
GIN_ROOT = str(paths.gin_root())
_UNKNOWN_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'")
_HELP_FLAGS = ('-h', '--help')


class Setting(NamedTuple):
  """A setting --help shows: a macro (GAMMA) or a parameter (infer.batch_size) and what
  it means; its value is the one the configuration it would run gives it."""
  name: str
  meaning: str


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


def parse(argv: list[str], description: str = '', add_flags=None,
          settings: Sequence[Setting] = (), config_dirs: Sequence[str] = ()) -> argparse.Namespace:
  """Parses gin flags, plus those add_flags(parser) adds, and applies the gin ones.

  settings: what --help lists, with the values of the configuration the flags name.
  config_dirs: the subdirectories of configs/ whose gin files --list_configs lists.
  Refuses a macro bound by a flag (--gin.NAME=VALUE) that no configuration uses: it
  would change nothing, and is most likely a typo of one that is used. What the user
  got wrong (a missing gin file, an unknown parameter, a typo) raises a
  jaxspec.errors.UserError.
  """
  parser = argparse.ArgumentParser(description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_gin_flags(parser)
  parser.add_argument('--data_dir', default=None,
                      help=f'the shipped corpora (default ${paths.DATA_DIR_ENV}, else data/ '
                      'of the working directory or of the checkout jaxspec runs from)')
  parser.add_argument('--checkpoint_dir', default=None,
                      help=f'the shipped checkpoints (default ${paths.CHECKPOINT_DIR_ENV}, '
                      'else checkpoints/ of the working directory or of the checkout)')
  if config_dirs:
    parser.add_argument('--list_configs', '--list-configs', action='store_true',
                        help='list the shipped configs of this command and what each runs')
  command.add_verbose_flag(parser)
  if add_flags:
    add_flags(parser)
  argv = rewrite_gin_args(argv)
  if any(arg in _HELP_FLAGS for arg in argv):
    parser.epilog = help_epilog(argv, settings, config_dirs)
  args = parser.parse_args(argv)
  if getattr(args, 'list_configs', False):
    print(list_configs(config_dirs), end='')
    raise SystemExit(0)
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
  shipped = (' The shipped configs are configs/<command>/<name>.gin; --list_configs lists '
             "a command's." if gin_file.startswith('configs') else '')
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


# --help and --list_configs: what a newcomer changes, and what ships.

_HELP_NAME_WIDTH = 25
_HELP_VALUE_WIDTH = 28


def format_value(value) -> str:
  """A bound value as gin would write it: 'auto', 0.0, ('speculative',), @jaxspec.X()."""
  if isinstance(value, gin.config.ConfigurableReference):
    return str(value)
  return repr(value)


def setting_value(name: str) -> str | None:
  """The value the parsed configuration gives a macro (NAME) or a parameter
  (configurable.parameter, else its default in the Python signature); None where the
  configuration has no such setting."""
  if '.' not in name:  # A macro.
    try:
      return format_value(gin.query_parameter(f'%{name}'))
    except ValueError:
      return None
  try:
    return format_value(gin.query_parameter(name))
  except ValueError:
    pass
  selector, _, parameter = name.rpartition('.')
  try:  # gin has no public way to reach a configurable's function.
    function = gin.config._REGISTRY.get_match(selector).wrapped  # pylint: disable=protected-access
    default = inspect.signature(function).parameters[parameter].default
  except Exception:  # A private API, or no such parameter: no value to show.
    return None
  return None if default is inspect.Parameter.empty else format_value(default)


def settings_table(settings: Sequence[Setting]) -> str:
  """One line a setting the configuration has: name, value, meaning."""
  lines = []
  for setting in settings:
    value = setting_value(setting.name)
    if value is None:
      continue
    if len(value) > _HELP_VALUE_WIDTH:  # The meaning on a line of its own.
      lines.append(f'  {setting.name:<{_HELP_NAME_WIDTH}} {value}')
      lines.append(f'  {"":<{_HELP_NAME_WIDTH + _HELP_VALUE_WIDTH}}  {setting.meaning}')
    else:
      lines.append(f'  {setting.name:<{_HELP_NAME_WIDTH}} {value:<{_HELP_VALUE_WIDTH}}  '
                   f'{setting.meaning}')
  return '\n'.join(lines)


def help_epilog(argv: list[str], settings: Sequence[Setting],
                config_dirs: Sequence[str]) -> str:
  """The end of --help: the main settings with the values of the configuration argv
  names (its gin files and bindings), and where the shipped configs are."""
  parser = argparse.ArgumentParser(add_help=False)
  _add_gin_flags(parser)
  known, _ = parser.parse_known_args([arg for arg in argv if arg not in _HELP_FLAGS])
  parts = []
  if settings:
    files = ', '.join(known.gin_file) or 'no --gin_file'
    files += ' and the flags' if known.gin_bindings else ''
    try:
      gin.clear_config()
      parse_gin(known.gin_file, known.gin_bindings, known.gin_search_paths)
    except errors.UserError as error:
      parts.append(f'main settings: not shown, the configuration does not parse: '
                   f'{command.one_line(error)}')
    else:
      parts.append('main settings (--gin.NAME=VALUE; the values of ' + files + '):\n'
                   + settings_table(settings))
  if config_dirs:
    root = os.path.join(GIN_ROOT, 'configs')
    shipped = ' and '.join(f'configs/{directory}/' for directory in config_dirs)
    parts.append(f'shipped configs: {shipped} in {root}\n'
                 f'  (--gin_file=configs/{config_dirs[0]}/<name>.gin; --list_configs lists them)')
  return '\n\n'.join(parts)


def config_summary(path: str) -> str:
  """What a gin file runs: the first sentence of its opening comment, without
  parentheses, cut to about 75 characters."""
  comment = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      if not line.startswith('#') or not line[1:].strip():
        break
      comment.append(line[1:].strip())
  text = ' '.join(comment)
  while re.search(r'\([^()]*\)', text):
    text = re.sub(r'\s*\([^()]*\)', '', text)
  sentence = re.split(r'(?<=\.)\s|:\s+python\s', text, maxsplit=1)[0].rstrip(':')
  if len(sentence) > 75:
    sentence = sentence[:72].rsplit(' ', 1)[0] + '...'
  return sentence


def list_configs(config_dirs: Sequence[str]) -> str:
  """The shipped configs under configs/<dir> for each of config_dirs: the --gin_file
  to give, and what each runs."""
  lines = [f'shipped configs (in {os.path.join(GIN_ROOT, "configs")}):']
  files = [f'configs/{directory}/{name}' for directory in config_dirs
           for name in sorted(os.listdir(os.path.join(GIN_ROOT, 'configs', directory)))
           if name.endswith('.gin')]
  width = max(map(len, files), default=0)
  for gin_file in files:
    lines.append(f'  --gin_file={gin_file:<{width}}  '
                 f'{config_summary(os.path.join(GIN_ROOT, gin_file))}')
  return '\n'.join(lines) + '\n'

"""Where jaxspec finds its shipped files: data, checkpoints and gin files.

The shipped corpora, vocabulary and checkpoints stay in the source checkout; a wheel
carries only the gin files (jaxspec/gin, jaxspec/configs). The data and checkpoints
are looked for, in order:

1. $JAXSPEC_DATA_DIR / $JAXSPEC_CHECKPOINT_DIR (the launchers' --data_dir and
   --checkpoint_dir set them), taken as given;
2. the working directory's data/ and checkpoints/, where they are jaxspec's (a
   checkout: run the commands from it after `pip install .`);
3. the checkout jaxspec is imported from (an editable install, or PYTHONPATH).

When none holds them, the error says where it looked and which flag or variable to set.
"""

from __future__ import annotations

import os
import pathlib

from jaxspec import errors

DATA_DIR_ENV = 'JAXSPEC_DATA_DIR'
CHECKPOINT_DIR_ENV = 'JAXSPEC_CHECKPOINT_DIR'
# A file every shipped data directory holds: what marks a data/ as jaxspec's.
DATA_MARKER = pathlib.PurePath('vocab', 'spm.model')
_PACKAGE = pathlib.Path(__file__).resolve().parent


def source_root() -> pathlib.Path:
  """The directory holding the jaxspec package: the checkout, for a source install."""
  return _PACKAGE.parent


def _found_in(name: str) -> list[tuple[str, pathlib.Path]]:
  """(what, directory) where `name` (data or checkpoints) is looked for without its
  variable: the working directory's, then the package's checkout's."""
  places = [('the working directory', pathlib.Path.cwd() / name),
            ('beside the jaxspec package', source_root() / name)]
  unique = []
  for what, directory in places:
    if all(directory.resolve() != seen.resolve() for _, seen in unique):
      unique.append((what, directory))
  return unique


def _not_found(what: str, name: str, looked_at, flag: str, variable: str) -> errors.MissingFile:
  """The error for `what` (the checkout's directory `name`) found at none of looked_at,
  (where, path) pairs."""
  looked = '; '.join(f'{path} ({where})' for where, path in looked_at)
  return errors.MissingFile(
      f'{what} not found: looked for {looked}. Run from a jaxspec checkout, or point '
      f"{flag} or ${variable} at a checkout's {name}/.")


def data_dir() -> pathlib.Path:
  """The shipped corpora and vocabulary: $JAXSPEC_DATA_DIR as given, else the first of
  the working directory's data/ and the package checkout's data/ holding the
  vocabulary. Raises jaxspec.errors.MissingFile naming where it looked."""
  explicit = os.environ.get(DATA_DIR_ENV)
  if explicit:
    return pathlib.Path(explicit)
  places = _found_in('data')
  for _, directory in places:
    if (directory / DATA_MARKER).is_file():
      return directory
  raise _not_found('the shipped data', 'data', [
      (where, path / DATA_MARKER) for where, path in places], '--data_dir', DATA_DIR_ENV)


def data_file(*parts: str) -> pathlib.Path:
  """data_dir()/parts, which must exist; else jaxspec.errors.MissingFile saying which
  directory was read and how to point at another."""
  directory = data_dir()
  path = directory.joinpath(*parts)
  if not path.exists():
    source = (f'${DATA_DIR_ENV}' if os.environ.get(DATA_DIR_ENV) else 'the data directory')
    raise errors.MissingFile(
        f'{path} does not exist ({source} is {directory}); point --data_dir or '
        f"${DATA_DIR_ENV} at a jaxspec checkout's data/")
  return path


def checkpoint_dir() -> pathlib.Path:
  """The shipped checkpoints: $JAXSPEC_CHECKPOINT_DIR as given, else the first of the
  working directory's checkpoints/ and the package checkout's that exists. Raises
  jaxspec.errors.MissingFile naming where it looked."""
  explicit = os.environ.get(CHECKPOINT_DIR_ENV)
  if explicit:
    return pathlib.Path(explicit)
  places = _found_in('checkpoints')
  for _, directory in places:
    if directory.is_dir():
      return directory
  raise _not_found('the shipped checkpoints', 'checkpoints', places, '--checkpoint_dir',
                   CHECKPOINT_DIR_ENV)


def gin_root() -> pathlib.Path:
  """The directory holding gin/ and configs/: the package's own copy in a wheel, else the
  checkout. Launchers search it for --gin_file and gin includes."""
  return _PACKAGE if (_PACKAGE / 'gin').is_dir() else source_root()


def resolve_checkpoint(path: str | None) -> str | None:
  """A checkpoint path as the launchers read it: absolute paths, URLs (gs://...) and
  paths that exist from the working directory as given; any other relative path under
  the checkpoints directories (without a leading 'checkpoints/', so the gin files'
  'checkpoints/ende54m/target' is found from any directory): $JAXSPEC_CHECKPOINT_DIR,
  else the working directory's checkpoints/ and the package checkout's. Raises
  jaxspec.errors.MissingFile naming where it looked when none holds it."""
  if not path or '://' in path or os.path.isabs(path) or os.path.exists(path):
    return path
  relative = pathlib.PurePath(path)
  if relative.parts and relative.parts[0] == 'checkpoints':
    relative = pathlib.PurePath(*relative.parts[1:])
  explicit = os.environ.get(CHECKPOINT_DIR_ENV)
  places = ([(f'${CHECKPOINT_DIR_ENV}', pathlib.Path(explicit))] if explicit
            else _found_in('checkpoints'))
  for _, directory in places:
    if (directory / relative).exists():
      return str(directory / relative)
  elsewhere = [f'{directory / relative} ({where})' for where, directory in places
               if (directory / relative).resolve() != pathlib.Path(path).resolve()]
  hint = ('' if any(directory.is_dir() for _, directory in places) else
          f' Run from a jaxspec checkout, or point --checkpoint_dir or ${CHECKPOINT_DIR_ENV} '
          "at a checkout's checkpoints/.")
  raise errors.MissingFile(f'no checkpoint at {path}'
                           + (f' nor at {"; ".join(elsewhere)}' if elsewhere else '') + '.'
                           + hint)


def atomic_write(path: str | os.PathLike, contents: bytes):
  """Writes contents to path through a temporary file beside it, flushed to disk first:
  a reader sees the old file or the whole new one, never a part."""
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(contents)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)

"""Where jaxspec finds its shipped files: data, checkpoints and gin files.

From a source checkout (editable install) the defaults are the checkout's `data/`,
`checkpoints/`, `gin/` and `configs/`. A wheel carries the gin files inside the package
(jaxspec/gin, jaxspec/configs) but not the data or checkpoints: point
$JAXSPEC_DATA_DIR and $JAXSPEC_CHECKPOINT_DIR (or the launchers' --data_dir and
--checkpoint_dir) at them.
"""

from __future__ import annotations

import os
import pathlib

DATA_DIR_ENV = 'JAXSPEC_DATA_DIR'
CHECKPOINT_DIR_ENV = 'JAXSPEC_CHECKPOINT_DIR'
_PACKAGE = pathlib.Path(__file__).resolve().parent


def source_root() -> pathlib.Path:
  """The directory holding the jaxspec package: the checkout, for a source install."""
  return _PACKAGE.parent


def data_dir() -> pathlib.Path:
  """$JAXSPEC_DATA_DIR, else the checkout's data/."""
  return pathlib.Path(os.environ.get(DATA_DIR_ENV) or source_root() / 'data')


def checkpoint_dir() -> pathlib.Path:
  """$JAXSPEC_CHECKPOINT_DIR, else the checkout's checkpoints/."""
  return pathlib.Path(os.environ.get(CHECKPOINT_DIR_ENV) or source_root() / 'checkpoints')


def gin_root() -> pathlib.Path:
  """The directory holding gin/ and configs/: the package's own copy in a wheel, else the
  checkout. Launchers search it for --gin_file and gin includes."""
  return _PACKAGE if (_PACKAGE / 'gin').is_dir() else source_root()


def resolve_checkpoint(path: str | None) -> str | None:
  """A checkpoint path as the launchers read it: absolute paths, URLs (gs://...) and
  paths that exist from the working directory as given; any other relative path under
  the checkpoints directory, without a leading 'checkpoints/' (so the gin files'
  'checkpoints/ende54m/target' is found from any directory)."""
  if not path or '://' in path or os.path.isabs(path) or os.path.exists(path):
    return path
  relative = pathlib.PurePath(path)
  if relative.parts and relative.parts[0] == 'checkpoints':
    relative = pathlib.PurePath(*relative.parts[1:])
  candidate = checkpoint_dir() / relative
  return str(candidate) if candidate.exists() else path

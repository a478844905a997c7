"""The errors that are the user's to fix, as opposed to jaxspec's own bugs.

A setting out of range, a missing or unreadable file, an input that cannot be decoded,
a checkpoint that is not there, an output directory busy with another run or holding
another run's records: each raises a UserError whose message names the problem and the
fix. The jaxspec-* commands print such an error as one line and exit with status 2
(jaxspec.launch.command); any other exception is a bug and keeps its traceback.

The concrete classes are also the built-in exceptions they were before (InvalidSetting
is a ValueError, MissingFile a FileNotFoundError), so Python callers catching those
keep working.
"""

from __future__ import annotations

import contextlib


class UserError(Exception):
  """What was asked cannot be done as asked; the message says what to change."""


class InvalidSetting(UserError, ValueError):
  """A setting, flag or input the program cannot use."""


class InvalidSettingType(UserError, TypeError):
  """A setting of the wrong kind (e.g. a number where a drafter belongs)."""


class MissingFile(UserError, FileNotFoundError):
  """A file or directory the run needs is not there."""


class UnreadableFile(UserError, OSError):
  """A file the run needs is there but cannot be read."""


def as_user_error(error: BaseException) -> UserError:
  """`error` (a ValueError, TypeError or OSError) as the UserError of its kind, with
  the same message."""
  if isinstance(error, UserError):
    return error
  if isinstance(error, FileNotFoundError):
    kind = MissingFile
  elif isinstance(error, OSError):
    kind = UnreadableFile
  elif isinstance(error, TypeError):
    kind = InvalidSettingType
  else:
    kind = InvalidSetting
  return kind(str(error))


@contextlib.contextmanager
def user_input():
  """Raises the ValueErrors, TypeErrors and OSErrors of the block as UserErrors.

  For the code that reads what the user gave (flags, gin files, settings, input files,
  the output directory) before anything is loaded: whatever goes wrong there is the
  user's to fix, whoever raised it."""
  try:
    yield
  except UserError:
    raise
  except (ValueError, TypeError, OSError) as error:
    raise as_user_error(error) from error

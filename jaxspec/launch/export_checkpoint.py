"""Copies a checkpoint of a training run into the repository, in bfloat16.

  python scripts/export_checkpoint.py /root/jaxspec_runs/ende/target checkpoints/ende/target
  python scripts/export_checkpoint.py /root/jaxspec_runs/ende54m/target \
      checkpoints/ende54m/target --step=2200          # a chosen step, not the latest

Writes a T5X legacy checkpoint (params only, no optimizer state) with bfloat16 arrays
on disk, which halves its size; loading casts to the model's param_dtype. Without
--step the run's latest checkpoint is exported (scripts/best_checkpoint.py picks one by
a validation metric). The destination's old contents are replaced only once the
checkpoint is read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from jaxspec import errors
from jaxspec.checkpoints import t5x as t5x_checkpoints
from jaxspec.launch import command


def checkpoint_directory(run_dir: str, step: int | None) -> tuple[str, int]:
  """The run's checkpoint_<step> directory (the latest when step is None) and its step."""
  if step is None:
    directory = t5x_checkpoints.find_t5x_checkpoint(run_dir).directory
    return directory, t5x_checkpoints.checkpoint_step(directory)
  steps = t5x_checkpoints.checkpoint_steps(run_dir)
  if step not in steps:
    raise errors.MissingFile(f'{run_dir} has no checkpoint_{step}; its steps: {steps}')
  return os.path.join(run_dir, f'checkpoint_{step}'), step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('run_dir')
  parser.add_argument('destination')
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--step', type=int, default=None,
                      help='the checkpoint_<step> to export (default: the latest)')
  command.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  directory, step = checkpoint_directory(args.run_dir, args.step)
  params = t5x_checkpoints.load_t5x_checkpoint(directory)
  if os.path.isdir(args.destination):
    shutil.rmtree(args.destination)
  path = t5x_checkpoints.save_t5x_checkpoint(args.destination, params, step, dtype=args.dtype)
  print(f'exported step {step} of {args.run_dir} to {path} ({args.dtype})')


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

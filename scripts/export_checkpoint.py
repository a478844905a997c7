"""Copies the latest checkpoint of a training run into the repository, in bfloat16.

  python scripts/export_checkpoint.py /root/jaxspec_runs/ende/target checkpoints/ende/target

Writes a T5X legacy checkpoint (params only, no optimizer state) with bfloat16 arrays
on disk, which halves its size; loading casts to the model's param_dtype.
"""

from __future__ import annotations

import argparse
import os
import shutil

from jaxspec.checkpoints import t5x as t5x_checkpoints


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('run_dir')
  parser.add_argument('destination')
  parser.add_argument('--dtype', default='bfloat16')
  args = parser.parse_args()
  location = t5x_checkpoints.find_t5x_checkpoint(args.run_dir)
  step = int(os.path.basename(location.directory).split('_')[-1])
  params = t5x_checkpoints.load_t5x_checkpoint(location.directory)
  if os.path.isdir(args.destination):
    shutil.rmtree(args.destination)
  path = t5x_checkpoints.save_t5x_checkpoint(args.destination, params, step, dtype=args.dtype)
  print(f'exported step {step} of {args.run_dir} to {path} ({args.dtype})')


if __name__ == '__main__':
  main()

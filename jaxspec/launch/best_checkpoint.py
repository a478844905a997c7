"""Prints the checkpoint of a training run that is best by a logged metric.

  python scripts/best_checkpoint.py /root/jaxspec_runs/ende54m/target \
      --metric=validation_xent --mode=min

Reads the run's train_log.jsonl (scripts/train.py writes one record per evaluation)
and prints the directory checkpoint_<step> of the best step among the checkpoints
still on disk; with no log, or no logged step still on disk, the latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxspec import errors
from jaxspec.checkpoints.t5x import checkpoint_steps
from jaxspec.launch import command


def best_step(run_dir: str, metric: str, mode: str) -> int:
  """The kept step whose logged `metric` is lowest (mode 'min') or highest ('max'); of
  equal scores the latest."""
  steps = checkpoint_steps(run_dir)
  if not steps:
    raise errors.MissingFile(f'{run_dir} holds no checkpoint_<step> directory')
  log_file = os.path.join(run_dir, 'train_log.jsonl')
  scores = {}
  if os.path.exists(log_file):
    with open(log_file) as f:
      for line in f:
        record = json.loads(line)
        if record.get('step') in steps and metric in record:
          scores[record['step']] = record[metric]
  if not scores:
    return steps[-1]
  pick = min if mode == 'min' else max
  return pick(sorted(scores, reverse=True), key=scores.get)  # Ties: the first, the latest.


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('run_dir')
  parser.add_argument('--metric', default='validation_xent')
  parser.add_argument('--mode', choices=('min', 'max'), default='min')
  command.add_verbose_flag(parser)
  args = parser.parse_args()
  step = best_step(args.run_dir, args.metric, args.mode)
  print(os.path.join(args.run_dir, f'checkpoint_{step}'))


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

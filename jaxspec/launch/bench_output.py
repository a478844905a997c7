"""What the side-by-side benchmark launchers (jaxspec-batch-sizes, jaxspec-staged-bench)
share: their common flags and list values, the results' file name, each record's
provenance and the JSON and markdown files it is written to."""

from __future__ import annotations

import json
import os
import re
import time

from jaxspec import inference, machine


def int_list(text: str) -> list[int]:
  """'1,2,4' -> [1, 2, 4] (a flag's value)."""
  return [int(x) for x in text.split(',') if x]


def float_list(text: str) -> list[float]:
  """'0,1' -> [0.0, 1.0] (a flag's value)."""
  return [float(x) for x in text.split(',') if x]


def add_run_flags(parser, output_dir: str):
  """The flags every benchmark launcher shares: --temperatures, --output_dir, --name."""
  parser.add_argument('--temperatures', default='0,1', type=float_list)
  parser.add_argument('--output_dir', default=output_dir)
  parser.add_argument('--name', default=None,
                      help='file name of the results (default: the machine, slugged)')


def machine_name() -> str:
  """The results' default file name: this machine's CPU model (or device), slugged."""
  described = machine.description()
  return re.sub(r'[^a-z0-9]+', '-', (
      described.get('cpu') or described['device']).lower()).strip('-')


def provenance(command: str, argv) -> dict:
  """The record's commit, date, machine (with its caches), 1-minute load and command."""
  return {'commit': (machine.git_commit() or '')[:7] or None,
          'date': time.strftime('%Y-%m-%d'), 'machine': machine.description(caches=True),
          'load_average': f'{os.getloadavg()[0]:.2f}',
          'command': ' '.join([command, *argv])}


def write_table(output_dir: str, name: str, record: dict, columns, title: str):
  """<output_dir>/<name>.json (the record) and .md (title, machine, commit and the rows'
  columns, floats to 2 places, None as '-'), each written whole."""
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, name)
  inference.write_text_atomic(path + '.json', json.dumps(record, indent=1))
  rows = [{k: (f'{v:.2f}' if isinstance(v, float) else '-' if v is None else v)
           for k, v in r.items()} for r in record['rows']]
  machine_line = ', '.join(f'{k} {v}' for k, v in record['provenance']['machine'].items())
  inference.write_text_atomic(path + '.md', (
      f"{title}, {machine_line}; commit {record['provenance']['commit']}.\n\n"
      + inference.markdown_table(rows, columns)))

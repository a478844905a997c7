"""Renders docs/benchmarks.md from the measurement records under results/.

  python scripts/render_benchmarks.py            # writes docs/benchmarks.md
  python scripts/render_benchmarks.py --check    # exits 1 if docs/benchmarks.md is stale

Every JSON record a launcher wrote under --results_dir (jaxspec-infer summaries,
jaxspec-benchmark sections, cost models, step costs, the peers comparison) becomes rows
of one table per kind, each row with the machine, date, commit, load average and command
of its record (jaxspec.measure.report). Paths are relative to the working directory.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxspec import errors
from jaxspec.measure import report
from jaxspec.launch import command


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--results_dir', default='results', help='the records (default results/)')
  parser.add_argument('--out', default=os.path.join('docs', 'benchmarks.md'),
                      help='the markdown file (default docs/benchmarks.md)')
  parser.add_argument('--check', action='store_true',
                      help='write nothing; exit 1 if --out differs from what would be written')
  command.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  if not os.path.isdir(args.results_dir):
    raise errors.MissingFile(f'{args.results_dir} is not a directory (--results_dir)')
  text = report.render(args.results_dir, link_base=os.path.dirname(args.out) or '.')
  if args.check:
    try:
      with open(args.out, encoding='utf-8') as f:
        current = f.read()
    except FileNotFoundError:
      current = None
    if current != text:
      print(f'{args.out} is stale: run `python scripts/render_benchmarks.py` '
            '(jaxspec-render-benchmarks) and commit it', file=sys.stderr)
      sys.exit(1)
    print(f'{args.out} is up to date')
    return
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w', encoding='utf-8') as f:
    f.write(text)
  print(f'wrote {args.out}')


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

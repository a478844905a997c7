"""Shows what speculative decoding did for one input: every iteration's drafts marked
accepted / rejected / corrected / bonus (the paper's Figure 1), in the terminal and as
a self-contained HTML page.

  python scripts/show.py                                    # ende_local, test example 0
  python scripts/show.py --pair=docsum_local --index=5 --verification=block
  python scripts/show.py --text="Open the file." --temperature=1 --html=view.html

The pair is one of the shipped pairs (jaxspec.pairs); `scripts/infer.py` writes the same
pages for the first N examples of a run with --gin.infer.view_examples=N.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from jaxspec.measure import decode_view
from jaxspec import errors, inference, pairs
from jaxspec.config import EOS_ID
from jaxspec.data import corpora
from jaxspec.decoding.speculative import VERIFICATIONS, SpeculativeConfig, speculative_generate
from jaxspec.sampling import SamplingConfig
from jaxspec.launch import command


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--pair', default='ende_local', choices=sorted(pairs.PAIRS))
  parser.add_argument('--draft', default='small', choices=pairs.DRAFTS)
  source = parser.add_mutually_exclusive_group()
  source.add_argument('--index', type=int, default=0, help='example of --split to show')
  source.add_argument('--text', default=None, help='show this input instead')
  parser.add_argument('--split', default='test')
  parser.add_argument('--gamma', type=int, default=None, help="default: the pair's gamma")
  parser.add_argument('--verification', default='token', choices=VERIFICATIONS)
  parser.add_argument('--draft_confidence_threshold', type=float, default=0.0)
  parser.add_argument('--temperature', type=float, default=0.0)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--html', default=None,
                      help='where to write the page (default results/views/PAIR_INDEX.html)')
  command.add_verbose_flag(parser)
  return parser.parse_args(argv)


def show(args) -> tuple[str, str, str]:
  """Decodes the input with a trace; -> (terminal text, HTML page, page path)."""
  pair = pairs.load(args.pair, args.draft)
  if args.text is None:
    examples = corpora.load_split(pair.task, args.split)
    if not 0 <= args.index < len(examples):
      raise errors.InvalidSetting(f'--index must be in [0, {len(examples)}) for {pair.task} '
                                  f'{args.split}, got {args.index}')
    text, name = examples[args.index]['inputs'], f'{args.split} example {args.index}'
  else:
    text, name = args.text, 'your text'
  spec = SpeculativeConfig(gamma=args.gamma or pair.gamma, verification=args.verification,
                           draft_confidence_threshold=args.draft_confidence_threshold)
  result = speculative_generate(
      pair.target_params, pair.draft_params, pair.encode([text]),
      jax.random.fold_in(jax.random.PRNGKey(args.seed), 0), target_config=pair.target_config,
      drafter=pair.drafter, spec=spec, max_decode_length=pair.max_decode_length,
      sampling=SamplingConfig(temperature=args.temperature), record_trace=True)
  title = (f'{pair.name} ({args.draft} draft), {name}: gamma {spec.gamma}, '
           f'{spec.verification} verification, temperature {args.temperature}')
  terminal, page = decode_view.render_row(result.trace, 0, pair.vocabulary.decode,
                                          title=title, input_text=text, eos_id=EOS_ID)
  path = args.html or os.path.join(
      'results', 'views', f"{args.pair}_{'text' if args.text else args.index}.html")
  return f'{title}\n{terminal}', page, path


def main(argv: list[str] | None = None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  terminal, page, path = show(args)
  inference.write_text_atomic(path, page)
  print(terminal)
  print(f'HTML: {path}')


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

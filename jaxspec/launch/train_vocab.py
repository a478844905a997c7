"""Trains the shared SentencePiece vocabulary of the shipped corpora.

A unigram model over the train splits of `ende` (English and German) and
`docsum` (Python code and English docstrings), with T5's special ids
(PAD 0, EOS 1, UNK 2, no BOS). Text is not normalized and whitespace is kept,
so code (newlines, indentation) decodes exactly; unseen characters fall back
to bytes. Training reads every sentence in file order with one thread, so the
model file is the same on every run.

  python scripts/train_vocab.py --data data/ --vocab-size 8000

Afterwards it prints token-length statistics of every split (inputs with the
task prefix and EOS, targets with EOS) for data/PROVENANCE.md.
"""

import argparse
import io
import json
import os
import statistics
import sys
import time

import sentencepiece

from jaxspec.config import EOS_ID, PAD_ID, UNK_ID  # pylint: disable=wrong-import-position
from jaxspec.data import corpora  # pylint: disable=wrong-import-position
from jaxspec.launch import command

SEED = 0


def training_sentences(data_dir):
  """Inputs and targets of both corpora's train splits, without task prefixes."""
  for corpus in corpora.CORPORA:
    for example in corpora.read_jsonl_gz(corpora.split_path(corpus, 'train', data_dir)):
      yield example['inputs']
      yield example['targets']


def train(data_dir, vocab_size):
  """Returns the serialized SentencePiece model."""
  sentencepiece.set_random_generator_seed(SEED)
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=training_sentences(data_dir),
      model_writer=model,
      model_type='unigram',
      vocab_size=vocab_size,
      character_coverage=1.0,
      byte_fallback=True,
      normalization_rule_name='identity',
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      split_digits=True,
      max_sentence_length=16384,
      input_sentence_size=0,  # every sentence, so no sampling
      shuffle_input_sentence=False,
      num_threads=1,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
      pad_piece='<pad>', eos_piece='</s>', unk_piece='<unk>',
      minloglevel=2)
  return model.getvalue()


def write_vocab_file(model_path):
  """Writes `<model>.vocab`: one `piece<TAB>score` line per id."""
  processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
  lines = [f'{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n'
           for i in range(processor.get_piece_size())]
  with open(model_path[:-len('.model')] + '.vocab', 'w', encoding='utf-8') as f:
    f.writelines(lines)


def percentile(values, fraction):
  return sorted(values)[min(len(values) - 1, int(fraction * len(values)))]


def token_stats(data_dir, vocab):
  """Mean / p95 / max token lengths per corpus and split, EOS included."""
  stats = {}
  for corpus in corpora.CORPORA:
    for split in corpora.SPLITS:
      examples = corpora.load_split(corpus, split, data_dir)
      pairs = [corpora.encode_example(e, corpus, vocab, 10**9, 10**9) for e in examples]
      for side, lengths in (('inputs', [len(p[0]) for p in pairs]),
                            ('targets', [len(p[1]) for p in pairs])):
        stats[f'{corpus}/{split}/{side}'] = {
            'mean': round(statistics.mean(lengths), 1),
            'p95': percentile(lengths, 0.95), 'max': max(lengths)}
  return stats


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--data', default='data/', help='corpora directory')
  parser.add_argument('--out', default=None, help='model path (default <data>/vocab/spm.model)')
  parser.add_argument('--vocab-size', type=int, default=8000)
  command.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  model_path = args.out or os.path.join(args.data, 'vocab', 'spm.model')
  start = time.time()
  model = train(args.data, args.vocab_size)
  os.makedirs(os.path.dirname(model_path), exist_ok=True)
  with open(model_path, 'wb') as f:
    f.write(model)
  write_vocab_file(model_path)
  seconds = round(time.time() - start, 1)
  stats = token_stats(args.data, corpora.Vocabulary(model_path))
  json.dump({'train_seconds': seconds, 'tokens': stats}, sys.stdout, indent=2)
  print()


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())

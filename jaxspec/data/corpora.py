"""The shipped corpora (`ende`, `docsum`), their vocabulary and T5 encoding.

The corpora are gzipped JSON lines `{"inputs", "targets", "source"}` under the
repository's `data/` directory (built by scripts/build_corpora.py, described in
data/PROVENANCE.md). `JAXSPEC_DATA_DIR` points elsewhere.

Encoding follows T5's WMT and CNN/DM seqio tasks: the task prefix is prepended
to the inputs, both features get EOS, and a too-long sequence is cut to
`length - 1` tokens before the EOS is appended
(`seqio.preprocessors.append_eos_after_trim`), so an encoded feature always
ends in EOS. Padding is left to the batcher.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
from collections.abc import Iterator, Sequence

import sentencepiece

from jaxspec import paths
from jaxspec.errors import InvalidSetting
from jaxspec.config import EOS_ID, PAD_ID, UNK_ID

CORPORA = ('ende', 'docsum')
SPLITS = ('train', 'validation', 'test')
TASK_PREFIXES = {
    'ende': 'translate English to German: ',
    'docsum': 'summarize: ',
}
# Inputs-only corpora (a train split of {'inputs', 'source'}, no references) -> the corpus
# whose task their inputs belong to; drafts trained on the target's own outputs read them.
INPUTS_ONLY = {'ende_inputs': 'ende'}
DATA_DIR_ENV = paths.DATA_DIR_ENV


def default_data_dir() -> pathlib.Path:
  """$JAXSPEC_DATA_DIR, else the working directory's or the checkout's `data/`
  (jaxspec.paths); raises jaxspec.errors.MissingFile, saying where it looked, without."""
  return paths.data_dir()


def read_jsonl_gz(path: str | os.PathLike) -> Iterator[dict]:
  """Yields one dict per line of a gzipped JSON-lines file."""
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    for line in f:
      yield json.loads(line)


def split_path(corpus: str, split: str, data_dir=None) -> pathlib.Path:
  """Path of `<data_dir>/<corpus>/<split>.jsonl.gz`."""
  inputs_only = corpus in INPUTS_ONLY and split == 'train'
  if not inputs_only and (corpus not in CORPORA or split not in SPLITS):
    raise InvalidSetting(f'unknown corpus/split {corpus!r}/{split!r}')
  return pathlib.Path(data_dir or default_data_dir()) / corpus / f'{split}.jsonl.gz'


def load_split(corpus: str, split: str, data_dir=None) -> list[dict]:
  """All examples of one split, in file order."""
  path = split_path(corpus, split, data_dir)
  if data_dir is None:  # The shipped file: a missing one says where it was looked for.
    path = paths.data_file(corpus, path.name)
  return list(read_jsonl_gz(path))


class Vocabulary:
  """SentencePiece vocabulary with T5's ids: PAD 0, EOS 1, UNK 2, no BOS."""

  pad_id = PAD_ID
  eos_id = EOS_ID
  unk_id = UNK_ID

  def __init__(self, model_path=None):
    model_path = model_path or paths.data_file('vocab', 'spm.model')
    self._processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    assert self._processor.pad_id() == PAD_ID
    assert self._processor.eos_id() == EOS_ID
    assert self._processor.unk_id() == UNK_ID

  @property
  def vocab_size(self) -> int:
    """Number of pieces; a model may pad its embedding beyond this."""
    return self._processor.get_piece_size()

  def encode(self, text: str) -> list[int]:
    """Token ids of text, without EOS."""
    return self._processor.encode(text, out_type=int)

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ids up to the first EOS, PAD skipped.

    Ids at or beyond `vocab_size` (rows of a padded embedding) decode as UNK,
    as in seqio.
    """
    pieces = []
    for token in (int(t) for t in ids):
      if token == EOS_ID:
        break
      if token != PAD_ID:
        pieces.append(token if token < self.vocab_size else UNK_ID)
    return self._processor.decode(pieces)


def trim_and_append_eos(ids: list[int], length: int) -> list[int]:
  """ids cut to length - 1, then EOS (seqio's append_eos_after_trim)."""
  return ids[:length - 1] + [EOS_ID]


def input_ids(example: dict, corpus: str, vocab: Vocabulary) -> list[int]:
  """Ids of `TASK_PREFIXES[corpus] + example['inputs']`, untrimmed, without EOS."""
  return vocab.encode(TASK_PREFIXES[corpus] + example['inputs'])


def encode_example(example: dict, corpus: str, vocab: Vocabulary,
                   input_length: int, target_length: int) -> tuple[list[int], list[int]]:
  """(input ids, target ids) of an example, as T5's seqio task would feed them.

  Inputs are `TASK_PREFIXES[corpus] + example['inputs']`; each side holds at
  most its length in tokens and always ends in EOS.
  """
  inputs = input_ids(example, corpus, vocab)
  targets = vocab.encode(example['targets'])
  return (trim_and_append_eos(inputs, input_length),
          trim_and_append_eos(targets, target_length))


def encoded_split(corpus: str, split: str, vocab: Vocabulary, input_length: int,
                  target_length: int, limit: int | None = None) -> list[tuple[list[int], list[int]]]:
  """(input ids, target ids) of a split's first `limit` examples (encode_example). An
  inputs-only corpus (INPUTS_ONLY) is encoded as its task's inputs with an empty target
  (EOS alone), for a caller that replaces the targets (the target model's outputs)."""
  examples = load_split(corpus, split)[:limit]
  task = INPUTS_ONLY.get(corpus)
  if task:
    return [(trim_and_append_eos(input_ids(e, task, vocab), input_length),
             trim_and_append_eos([], target_length)) for e in examples]
  return [encode_example(e, corpus, vocab, input_length, target_length) for e in examples]

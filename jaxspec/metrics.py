"""Task metrics, as T5's tasks report them: corpus BLEU (sacrebleu) and ROUGE."""

from __future__ import annotations

from typing import Sequence


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> float:
  """Corpus BLEU with sacrebleu's defaults (13a tokenization), as t5's `bleu` metric."""
  import sacrebleu
  return float(sacrebleu.corpus_bleu(list(predictions), [list(targets)]).score)


def rouge(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Mean ROUGE-1/2/Lsum F-measure x 100, as t5's `rouge` metric."""
  from rouge_score import rouge_scorer, scoring
  scorer = rouge_scorer.RougeScorer(['rouge1', 'rouge2', 'rougeLsum'])
  aggregator = scoring.BootstrapAggregator()
  for target, prediction in zip(targets, predictions):
    # rougeLsum splits summaries at newlines.
    aggregator.add_scores(scorer.score(target.replace('. ', '.\n'),
                                       prediction.replace('. ', '.\n')))
  result = aggregator.aggregate()
  return {name: float(score.mid.fmeasure * 100) for name, score in result.items()}


TASK_METRICS = {'ende': 'bleu', 'docsum': 'rouge'}


def task_metric(corpus: str, targets: Sequence[str], predictions: Sequence[str]) -> dict:
  if TASK_METRICS.get(corpus) == 'bleu':
    return {'bleu': bleu(targets, predictions)}
  return rouge(targets, predictions)

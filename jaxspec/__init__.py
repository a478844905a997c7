"""jaxspec: exact speculative decoding for T5 encoder-decoders in JAX.

The public surface, importable from `jaxspec` alone:

  pairs, load_pair                the shipped model pairs, text in / text out
  T5Config, get_config            model configurations (T5.1.1, T5 1.0, the local pairs)
  init_params, load_checkpoint    random parameters; a T5X checkpoint's parameters
  SamplingConfig                  temperature / top-k / top-p (the target's and draft's)
  generate                        the baseline decoder (one target step a token)
  temperature_sample              T5X's decoding.temperature_sample, as T5X calls it
  SpeculativeConfig               gamma, verification rule, lenience, ...
  speculative_generate            speculative decoding (the target's outputs, exactly)
  BeamConfig, generate_beam, beam_search
  SpeculativeBeamConfig, speculative_beam_generate
  Drafter, DraftContext           the drafter interface (a base class)
  T5Drafter, Int8Drafter, SharedEncoderDrafter, PromptLookupDrafter,
  UnigramDrafter, BigramDrafter, fit_unigram, fit_bigram
  StagedDrafter, StageStats       a drafter decoded speculatively with a cheaper proposer
  EOS_ID, PAD_ID

Everything else lives in the subpackages: decoding (decoders, drafters/, verification/),
model (the T5 network, its cache, model/cpu kernels), checkpoints, data, training,
measure, integrations (t5x), launch (the command-line programs).
"""

from jaxspec import pairs
from jaxspec.config import EOS_ID, PAD_ID, T5Config, get_config
from jaxspec.decoding.baseline import generate, temperature_sample
from jaxspec.decoding.beam_search import BeamConfig, beam_search, generate_beam
from jaxspec.decoding.drafters import (BigramDrafter, DraftContext, Drafter, FeatureDrafter,
                                       Int8Drafter,
                                       PromptLookupDrafter, SharedEncoderDrafter,
                                       StagedDrafter, StageStats, T5Drafter, UnigramDrafter,
                                       fit_bigram, fit_unigram)
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig, speculative_beam_generate
from jaxspec.inference import load_model_params as load_checkpoint
from jaxspec.model import init_params
from jaxspec.pairs import load as load_pair
from jaxspec.sampling import SamplingConfig

__all__ = [
    'BeamConfig', 'BigramDrafter', 'DraftContext', 'Drafter', 'EOS_ID', 'FeatureDrafter',
    'Int8Drafter',
    'PAD_ID', 'PromptLookupDrafter', 'SamplingConfig', 'SharedEncoderDrafter',
    'SpeculativeBeamConfig', 'SpeculativeConfig', 'StageStats', 'StagedDrafter', 'T5Config',
    'T5Drafter', 'UnigramDrafter',
    'beam_search', 'fit_bigram', 'fit_unigram', 'generate', 'generate_beam', 'get_config',
    'init_params', 'load_checkpoint', 'load_pair', 'pairs', 'speculative_beam_generate',
    'speculative_generate', 'temperature_sample',
]

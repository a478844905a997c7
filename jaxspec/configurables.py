"""Registers jaxspec's configuration dataclasses and drafters with gin, under module
'jaxspec'.

Imported only by scripts (gin lives at the edges); the library never parses gin.
Bindings look like `jaxspec.T5Config.emb_dim = 256`.
"""

import gin

from jaxspec.config import T5Config
from jaxspec.decoding.beam_search import BeamConfig
from jaxspec.decoding.drafters import (BigramDrafter, FeatureDrafter, Int8Drafter,
                                       PromptLookupDrafter,
                                       SharedEncoderDrafter, StagedDrafter, T5Drafter,
                                       UnigramDrafter)
from jaxspec.decoding.speculative import SpeculativeConfig
from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig
from jaxspec.training.distillation import DataMixConfig, DivergenceConfig
from jaxspec.partitioning import PartitioningConfig
from jaxspec.sampling import SamplingConfig
from jaxspec.training.core import LossConfig, OptimizerConfig
from jaxspec.training.feature_draft import FeatureLossConfig

for _cls in (T5Config, SamplingConfig, SpeculativeConfig, BeamConfig, SpeculativeBeamConfig,
             OptimizerConfig, LossConfig, PartitioningConfig, DivergenceConfig, DataMixConfig,
             FeatureLossConfig):
  gin.external_configurable(_cls, module='jaxspec')

for _drafter in (T5Drafter, UnigramDrafter, BigramDrafter, PromptLookupDrafter,
                 SharedEncoderDrafter, Int8Drafter, StagedDrafter, FeatureDrafter):
  gin.external_configurable(_drafter, module='jaxspec')

"""The feature-level draft head (EAGLE-style) both workers serve: the model and its KV cache
(head), how it is stored (checkpoint), its packed CPU form (cpu) and the drafting policy
(policy: chains, alternatives, n-gram fallback). Training lives in specdec.train.

The names below are the head's public API, used as `from specdec import eagle; eagle.load(...)`.
"""

from specdec.eagle.checkpoint import fingerprint, is_eagle_dir, load, save, warm_start
from specdec.eagle.cpu import fast_cpu_dtype, fast_cpu_head
from specdec.eagle.head import (
    CONFIG_NAME, FEATURE_BYTES, FEATURE_DTYPE, KIND, WEIGHTS_NAME, EagleConfig, EagleHead, HeadCache, build,
    new_config, target_parts,
)
from specdec.eagle.policy import MIN_ALT_PROB, MIN_CHAIN_PROB, EagleDrafter, Features

__all__ = [
    "CONFIG_NAME", "FEATURE_BYTES", "FEATURE_DTYPE", "KIND", "MIN_ALT_PROB", "MIN_CHAIN_PROB", "WEIGHTS_NAME",
    "EagleConfig", "EagleDrafter", "EagleHead", "Features", "HeadCache", "build", "fast_cpu_dtype", "fast_cpu_head",
    "fingerprint", "is_eagle_dir", "load", "new_config", "save", "target_parts", "warm_start",
]

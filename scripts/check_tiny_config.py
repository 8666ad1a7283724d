"""Checks that models/strata-tiny loads in the installed transformers (5.17 and 5.18 both
must): the config always, and with torch the model runs a forward pass.

    python scripts/check_tiny_config.py [MODEL_DIR]

Prints the version, the layer types transformers settled on and (with torch) the first
logits' checksum, so two versions can be compared; exits 1 on any failure.
"""
import sys

import transformers
from transformers import AutoConfig

model_dir = sys.argv[1] if len(sys.argv) > 1 else "models/strata-tiny"
print("transformers", transformers.__version__)
try:
    cfg = AutoConfig.from_pretrained(model_dir)
except Exception as e:  # noqa: BLE001 - report whatever transformers raised
    print(f"config FAILED: {type(e).__name__}: {e}")
    sys.exit(1)
print("config OK:", type(cfg).__name__, "layer_types", sorted(set(cfg.layer_types)))
try:
    import torch
except ImportError:
    print("torch not installed: model not instantiated")
    sys.exit(0)
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])).logits
print("model OK:", type(model).__name__, tuple(logits.shape), f"logit checksum {float(logits.sum()):.6f}")

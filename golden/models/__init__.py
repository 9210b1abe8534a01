"""Deterministic golden models: specs (``spec``), the generator (``build``) and the manifest.

``python -m lockstep.golden.models --write`` regenerates every variant's ``.onnx`` and ``manifest.json``;
``python -m lockstep.golden.models --check`` rebuilds in memory and fails on drift. See README.md here.
"""

from .build import (
                    MANIFEST,
                    MODELS_DIR,
                    build,
                    check_models,
                    empty_past,
                    prompt_feeds,
                    prompt_ids,
                    reference_forward,
                    serialize,
                    sha256_of,
                    stored_weights,
                    weights_from_model,
                    write_models,
)
from .spec import GENERATOR_VERSION, NEAR_TIE, PROMPT, VARIANTS, ModelSpec, NearTie, spec_dict

__all__ = [
    "GENERATOR_VERSION", "MANIFEST", "MODELS_DIR", "NEAR_TIE", "PROMPT", "VARIANTS", "ModelSpec", "NearTie",
    "build", "check_models", "empty_past", "prompt_feeds", "prompt_ids", "reference_forward", "serialize",
    "sha256_of", "spec_dict", "stored_weights", "weights_from_model", "write_models",
]

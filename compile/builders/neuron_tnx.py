"""The `neuron-tnx` build step: compile a Llama checkpoint with transformers-neuronx (tensor parallel,
continuous batching, the grid's buckets; see `app/backends/neuron/tnx.py` for the configuration and why)
and save it as an artifact: the NEFFs (`<hlo hash>.neff`) in `compiled/`, the presharded weights
(`decoder_layer_{i}.safetensors`, `DecoderLMHead.safetensors`) and the library's `config.json` in
`weights/`.

Needs the `neuron-tnx` extra (Neuron SDK 2.25, AWS's Neuron repository) and neuronx-cc. Compiling runs
without a device (`cpu_compile`); the validation gate that follows needs an inf2/trn1 host.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from app.backends.base import BackendSpec
from app.backends.neuron.runtime import import_library
from app.backends.neuron.steps import check_grid
from app.backends.neuron.tnx import LIBRARY, check_context_buckets, check_quantization, model_kwargs
from app.llama import LlamaSpec

BACKEND = "neuron-tnx"


def check(llama: LlamaSpec, spec: BackendSpec) -> None:
    check_grid(spec)
    check_context_buckets(spec)
    check_quantization(spec)


def build(checkpoint_dir: Path, staging_dir: Path, spec: BackendSpec, llama: LlamaSpec) -> None:
    library = import_library(LIBRARY, BACKEND)
    model = library.LlamaForSampling.from_pretrained(str(checkpoint_dir), **model_kwargs(library, spec))
    model.cpu_compile()
    with tempfile.TemporaryDirectory(prefix="inf2serve-tnx-") as scratch:
        model.save(scratch, sharded_weights=True)
        for kind in ("compiled", "weights"):
            (staging_dir / kind).mkdir(parents=True, exist_ok=True)
        for path in Path(scratch).iterdir():
            kind = "compiled" if path.suffix == ".neff" else "weights"
            shutil.move(path, staging_dir / kind / path.name)

"""The portable torch backend: a Llama runtime over Inferentia's static shapes (see `backend.py`)."""

from app.backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]

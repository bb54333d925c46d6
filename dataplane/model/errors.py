"""The model runner's exception tree: one root, each refusal named."""
from __future__ import annotations


class ModelError(Exception):
    """Root of every error the model package raises on purpose."""


class UnsupportedModel(ModelError):
    """The file or directory describes something this runner does not implement (architecture,
    quantization type, RoPE scaling kind, tokenizer model); the message names which."""


class ModelFileError(ModelError):
    """A model file is missing, truncated or inconsistent with itself."""


class ChatTemplateMissing(ModelError):
    """The model ships no chat template, so a conversation cannot be rendered the model's way."""


class BatchError(ModelError):
    """A forward batch the runner refuses: the message names the sequence and the field."""


class OutOfSlots(ModelError):
    """The in-memory slot allocator used by ``generate`` has no free block left."""

"""The model runner: Llama-family weights (GGUF or safetensors), tokenizer and chat template,
a paged-KV forward for mixed prefill/decode batches, sampling, prefix keys, a small engine."""
from residency.dataplane.model.config import LLAMA3_8B, SMOLLM2_135M, ModelConfig, RopeScaling
from residency.dataplane.model.engine import BlockManager, GenerationOutput, LocalEngine, chat, generate
from residency.dataplane.model.errors import (
    BatchError,
    ChatTemplateMissing,
    ModelError,
    ModelFileError,
    OutOfSlots,
    UnsupportedModel,
)
from residency.dataplane.model.loader import LoadedModel, embedded_model_path, load_model, random_model
from residency.dataplane.model.prefix import KeyChain, block_content_keys
from residency.dataplane.model.runner import ModelRunner, SeqInput, StepPlan
from residency.dataplane.model.sampler import SamplingParams, make_generator, sample
from residency.dataplane.model.tokenizer import IncrementalDecoder, Tokenizer
from residency.dataplane.model.tp import Refused, TensorParallel, TensorParallelRefused, init_group, refuse_tp
from residency.dataplane.model.weights import Weights, to_hf_state_dict

__all__ = [
    "LLAMA3_8B", "SMOLLM2_135M", "ModelConfig", "RopeScaling",
    "BlockManager", "GenerationOutput", "LocalEngine", "chat", "generate",
    "BatchError", "ChatTemplateMissing", "ModelError", "ModelFileError", "OutOfSlots", "UnsupportedModel",
    "LoadedModel", "embedded_model_path", "load_model", "random_model",
    "KeyChain", "block_content_keys",
    "ModelRunner", "SeqInput", "StepPlan",
    "SamplingParams", "make_generator", "sample",
    "IncrementalDecoder", "Tokenizer",
    "Refused", "TensorParallel", "TensorParallelRefused", "init_group", "refuse_tp",
    "Weights", "to_hf_state_dict",
]

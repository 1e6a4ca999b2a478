"""The reference engine: a small paged-KV, radix-cached, continuously batching LLM engine."""

from .config import EngineConfig, ModelConfig
from .engine import Engine
from .pd import PDPair
from .request import Request
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Engine", "EngineConfig", "ModelConfig", "PDPair", "Request"]

"""Torch-free tokenization: tokenizer bundles (HF dir or GGUF), chat templates, streaming detokenizer."""
from tokenization.bundle import TokenizerBundle
from tokenization.detokenizer import IncrementalDetokenizer

__all__ = ["TokenizerBundle", "IncrementalDetokenizer"]

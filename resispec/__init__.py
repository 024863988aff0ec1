"""ResiSpec: train draft models for exact multi-candidate speculative decoding, and serve them."""

__version__ = "0.1.0"

"""worldpipe: a reproducible experiment pipeline for training world models."""

__version__ = "0.1.0"

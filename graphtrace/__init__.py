"""graphtrace: find the tensors a CUDA graph will read stale after a weight reload."""
__version__ = "0.1.0"

"""Checkpoints: atomic save, safe (weights_only) load, keep-last/keep-best, safetensors export."""

from stoker.checkpoint.export import export_safetensors, load_safetensors_into
from stoker.checkpoint.io import load_checkpoint, save_atomic
from stoker.checkpoint.store import Checkpointer, find_latest

__all__ = [
    "Checkpointer",
    "export_safetensors",
    "find_latest",
    "load_checkpoint",
    "load_safetensors_into",
    "save_atomic",
]

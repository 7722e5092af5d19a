"""Checkpoints: crash-consistent, verified checkpoint folders; safe (weights_only) loads.

See :mod:`stoker.checkpoint.layout` for the folder layout.
"""

from stoker.checkpoint.export import export_safetensors, load_safetensors_into
from stoker.checkpoint.io import load_state_file, save_atomic
from stoker.checkpoint.layout import find_latest, find_latest_valid, load_checkpoint
from stoker.checkpoint.manifest import (
    DamagedCheckpointError,
    is_checkpoint_dir,
    verify_checkpoint,
)
from stoker.checkpoint.store import Checkpointer

__all__ = [
    "Checkpointer",
    "DamagedCheckpointError",
    "export_safetensors",
    "find_latest",
    "find_latest_valid",
    "is_checkpoint_dir",
    "load_checkpoint",
    "load_safetensors_into",
    "load_state_file",
    "save_atomic",
    "verify_checkpoint",
]

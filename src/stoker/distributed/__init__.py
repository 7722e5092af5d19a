"""stoker.distributed."""

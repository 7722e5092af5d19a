"""stoker.cli."""

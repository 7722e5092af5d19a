"""stoker.train."""

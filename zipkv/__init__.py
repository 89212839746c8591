"""zipkv."""

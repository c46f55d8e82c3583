"""observing."""

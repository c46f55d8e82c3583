"""_kits."""

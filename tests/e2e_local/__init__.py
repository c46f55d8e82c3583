"""The end-to-end chain on two real nodes (see conftest.py)."""

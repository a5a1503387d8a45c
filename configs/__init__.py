"""Semantic configs shipped with the package (JSON data)."""

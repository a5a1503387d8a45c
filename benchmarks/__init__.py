"""Benchmarks kept outside the package: peers' code runs here as baselines, never inside ``minference_fx``."""

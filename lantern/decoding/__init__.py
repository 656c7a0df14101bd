"""The decoding engine: one loop, acceptance rules, trees, caches, sampling, drafter logic.

Imports nothing above it: no model family, no stack, no CLI (tests/test_layering.py).
"""

"""Measuring runs: bench, quality metrics, demo, round traces.
"""

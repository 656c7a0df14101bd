"""The ``lantern`` command: a thin layer over the library (``python -m lantern.cli``).
"""

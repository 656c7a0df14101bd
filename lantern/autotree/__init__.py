"""Choosing a draft tree (and a Jacobi window) from measured acceptance and device costs.
"""

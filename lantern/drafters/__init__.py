"""Draft backends bound to models: EAGLE drafters, LANTERN's released Chameleon drafters, the oracle.
"""

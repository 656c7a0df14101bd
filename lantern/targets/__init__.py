"""Model families behind the loop's ``Target`` protocol: LlamaGen (c2i, t2i with its T5 front end) and the
Chameleon family, the stacks that load them, proximity tables and checks.
"""

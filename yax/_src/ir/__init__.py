"""The MoX data model: nodes, their variables and arguments, lowering to
Jaxprs, per-primitive rules, the invariant checker.
"""

"""From a JAX callable to a tree (``make_mox``: markers, calls, the Linen
and NNX frontends) and back (``eval_mox``).
"""

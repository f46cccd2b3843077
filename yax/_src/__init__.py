"""YAX's implementation; ``yax/__init__.py`` is the public surface.

The modules directly here are the foundations (errors, the one home of
JAX/Flax internals, the version); the packages are layered, lowest
first: ``ir``, ``trace``, ``views``, ``rewrite``, ``tools``, ``report``,
``cli`` (``tests/test_layering.py`` checks it; ``docs/design.md``,
"Layers", says why).
"""

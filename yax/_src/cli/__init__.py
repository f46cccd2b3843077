"""The ``yax`` command and its bundled example models.
"""

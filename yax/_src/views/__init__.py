"""Read-only renderings of a tree: Jaxpr text, the XML view (and JSON,
YSON), XPath queries over it.
"""

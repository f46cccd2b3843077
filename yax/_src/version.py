"""The version of the package (``yax.__version__``), kept in the lowest layer
so that any module can show it without importing ``yax`` itself."""

__version__ = '0.1.0'

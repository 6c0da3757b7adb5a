"""magis_nb: MAGIS memory optimization for PyTorch, driven from a notebook."""
__version__ = "0.1.0"

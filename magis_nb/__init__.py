"""magis_nb: MAGIS memory optimization for PyTorch, driven from a notebook."""
__version__ = "0.1.0"


def load_ipython_extension(ip):
    """``%load_ext magis_nb``: registers ``%%magis`` and ``%magis_budget``."""
    from .notebook import load_ipython_extension as load
    load(ip)


def unload_ipython_extension(ip):
    """``%unload_ext magis_nb``: removes the magics again."""
    from .notebook import unload_ipython_extension as unload
    unload(ip)

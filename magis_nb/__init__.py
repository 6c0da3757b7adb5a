"""magis_nb: MAGIS memory optimization for PyTorch, driven from a notebook."""
__version__ = "0.1.0"


def __getattr__(name):
    # `optimize` pulls in torch and the whole pipeline: import it on first use so
    # that `import magis_nb` (and `%load_ext magis_nb`) stays cheap.
    if name == "optimize":
        from .search import optimize
        return optimize
    raise AttributeError(f"module 'magis_nb' has no attribute {name!r}")


def load_ipython_extension(ip):
    """``%load_ext magis_nb``: registers ``%%magis`` and ``%magis_budget``."""
    from .notebook import load_ipython_extension as load
    load(ip)


def unload_ipython_extension(ip):
    """``%unload_ext magis_nb``: removes the magics again."""
    from .notebook import unload_ipython_extension as unload
    unload(ip)

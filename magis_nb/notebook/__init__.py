"""The notebook layer: ``%%magis``, ``%magis_budget``, progress, plots, slider, report.

Loaded by ``%load_ext magis_nb``; importing ``magis_nb`` alone does not import this
package (nor IPython widgets or matplotlib).
"""
from __future__ import annotations


def load_ipython_extension(ip) -> None:
    from .magic import MagisMagics
    ip.register_magics(MagisMagics)


def unload_ipython_extension(ip) -> None:
    from .magic import MagisMagics
    mm = ip.magics_manager
    for kind in ("line", "cell"):
        for name, fn in list(mm.magics[kind].items()):
            if isinstance(getattr(fn, "__self__", None), MagisMagics):
                del mm.magics[kind][name]
    mm.registry.pop(MagisMagics.__name__, None)

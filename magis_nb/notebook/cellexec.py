"""Run a cell body in the user namespace the way ``%%time`` does.

One execution (transform_cell + compile + exec, no nested run_cell, so IPython's
events fire once), IPython syntax works (``!ls``, ``%time`` inside), and the source
is cached under the cell's name so a traceback shows "Cell In[n], line k" with the
line, numbered as the user sees the cell (the ``%%magis`` line is line 1).
"""
from __future__ import annotations


def run_cell_body(shell, cell: str) -> str:
    """Execute ``cell`` in ``shell.user_ns``; return the transformed source."""
    __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
    source = shell.transform_cell(cell)
    # A leading newline stands for the %%magis line: cell line numbers stay right.
    shown = "\n" + source
    name = shell.compile.cache(shown, shell.execution_count, raw_code="\n" + cell)
    tree = shell.compile.ast_parse(shown, filename=name)
    tree = shell.transform_ast(tree)
    code = shell.compile(tree, name, "exec")
    exec(code, shell.user_ns)
    return source

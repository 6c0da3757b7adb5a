"""A failed trace as a message that says what to do, and the line to look at."""
from __future__ import annotations

import os
import traceback

from .specialize import RandomBranchError, is_data_dependent
from .switches import outside


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The traceback's frames outside torch and magis_nb (the user's code, or the
    library the model comes from, ``transformers``), outermost first, from the
    first exception of the chain that has any: the export re-raises fake-tensor
    errors."""
    tb = exc
    while tb is not None:
        frames = [fs for fs in traceback.extract_tb(tb.__traceback__) if outside(fs.filename)]
        if frames:
            return frames
        tb = tb.__cause__ or tb.__context__
    return []


def user_frame(exc: BaseException) -> str | None:
    """The innermost line of the traceback outside torch and magis_nb."""
    frames = _user_frames(exc)
    if not frames:
        return None
    fs = frames[-1]
    return f"{fs.filename}:{fs.lineno}: {fs.line or ''}".rstrip()


_CTC_EXAMPLE = """
    def ctc(out, labels):                                  # labels padded with -100
        logp = out.logits.log_softmax(-1).transpose(0, 1)  # (frames, batch, vocab)
        frames = torch.full((logp.shape[1],), logp.shape[0])
        return F.ctc_loss(logp, labels.clamp(min=0), frames, (labels >= 0).sum(-1),
                          blank=model.config.pad_token_id, reduction="sum")
    optimize(model, ({inputs}), loss_fn=ctc)"""

_CE_EXAMPLE = """
    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, -2), labels.flatten())
    optimize(model, ({inputs}), loss_fn=loss_fn)"""


def _in_own_loss(fs: traceback.FrameSummary) -> bool:
    """Whether a line of the model's code computes its loss: a function or file
    named for it (transformers' ``loss/loss_ctc.py: ForCTCLoss``), or a line
    reading the labels (DeBERTa-v2's ``(labels >= 0).nonzero()``)."""
    words = f"{os.path.basename(fs.filename)} {fs.name} {fs.line or ''}".lower()
    return "loss" in words or "label" in words


def _own_loss_hint(fs: traceback.FrameSummary, keys: list[str], cause: str) -> str:
    """Pass loss_fn instead, with a short example (CTC where the loss is CTC)."""
    labels = next((k for k in keys if "label" in k.lower()), "labels")
    inputs = ", ".join(([f'batch["{k}"]' for k in keys if k != labels] or ["inputs..."])
                       + [f'batch["{labels}"]'])
    ctc = "ctc" in f"{fs.filename} {fs.name} {fs.line or ''}".lower()
    example = (_CTC_EXAMPLE if ctc else _CE_EXAMPLE).format(inputs=inputs)
    return (f"the model's own loss makes a tensor whose shape depends on tensor values "
            f"({os.path.basename(fs.filename)}:{fs.lineno}, in {fs.name}: {cause}): a plan "
            "needs every shape known before the step runs. Compute the loss yourself: leave "
            f"`{labels}` out of the model's call and pass loss_fn, called as "
            "loss_fn(model output, last input), with the inputs as a tuple in forward()'s "
            f"order and the labels last, e.g.{example}")


def explain(exc: BaseException, *, own_loss: bool = False, keys: list[str] = ()) -> str:
    """``exc`` (a failed trace) as what went wrong and what to do. ``own_loss``:
    the step is the model's own loss (training without loss_fn); ``keys``: the
    batch's keyword arguments, for the example of a loss_fn."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, RandomBranchError):
        return str(exc)
    if is_data_dependent(exc):
        return ("forward() has Python control flow that depends on tensor values "
                "(an `if`/`while` on a tensor, .item(), .tolist()) that could not be "
                "specialized on the example inputs; make it shape-only (torch.where) "
                f"or move it out of forward() ({name}: {msg})")
    if "DynamicOutputShape" in name or "dynamic output shape" in text.lower():
        frames = _user_frames(exc)
        if own_loss and frames and _in_own_loss(frames[-1]):
            return _own_loss_hint(frames[-1], list(keys), msg)
        return ("forward() makes a tensor whose shape depends on tensor values "
                "(nonzero, boolean-mask indexing x[mask], unique, masked_select); a plan "
                "needs every shape known before the step runs: compute with the mask "
                "instead (torch.where, multiplying by it) or move it out of forward() "
                f"({name}: {msg})")
    if "requires gradients, and received a mutation" in text:
        return ("forward() writes into a trainable parameter in place (nn.Embedding("
                "max_norm=...) renormalizes the rows it looks up; or a weight updated "
                "under torch.no_grad()): a planned step cannot write its own parameters; "
                "make that update outside the step (for Embedding: drop max_norm, or "
                "call torch.embedding_renorm_ on the weight before each step) "
                f"({name}: {msg})")
    if "does not require gradients" in text:
        return ("the loss does not depend on any trainable parameter: nothing to train "
                "(use mode='infer' for a forward pass)")
    if isinstance(exc, (RuntimeError, IndexError)) and (
            "shape" in text or "size" in text or "dim" in text or "mat" in text
            or "expected" in text.lower() or "out of range" in text):
        return f"the example inputs do not fit the model: {msg}"
    return f"tracing the model failed ({name}: {msg})"

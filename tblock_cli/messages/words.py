"""Small formatting helpers the message tables share (no torch, no Rich)."""

from __future__ import annotations


def of_update(f: dict) -> str:
    """', 2.3x what the block adds to its input there' where a difference was judged against the block's update
    (`update_share` in the facts) and passed its 1 % (the checks' UPDATE_SHARE); '' otherwise."""
    share = f.get("update_share", 0)
    return f", {share:.2g}x what the block adds to its input there" if share > 0.01 else ""


def shape(dims) -> str:
    return str(tuple(dims))


def names(items) -> str:
    return ", ".join(items)


def span(values, fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def layer_prefix(layer) -> str:
    return "" if layer is None else f"layer {layer}: "


def scale_note(note) -> str:
    """An attention call's ScaleNote as the attention check's facts carry it."""
    if note.kind == "zero":
        return "q or k is zero"
    if note.kind == "cosine":
        return "q and k reach the product as unit vectors (cosine attention: its scale is a temperature, not judged)"
    if note.kind == "no_softmax":
        return "no softmax: the raw scores weight the values"
    if note.kind == "mixed":
        return "each head's scores mix other heads' q.k products (talking heads): no one scale, not judged"
    if note.kind == "mha":
        return "scale 1/sqrt(d_head), built into nn.MultiheadAttention"
    text = "the q and k that reach the product" + (f" (a factor {note.folded:.4g} folded into them)"
                                                   if note.folded != 1.0 else "")
    if note.sdpa:
        text += "; scale " + (f"{note.passed:.4g} passed" if note.passed is not None else "1/sqrt(E) by default")
    return text

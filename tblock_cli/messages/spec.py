"""The words of `tblock spec` and of the `spec` and `like_reference` checks."""

from __future__ import annotations


def shown(v) -> str:
    """A card value as the card prints it: numbers to 4 significant digits, tuples shortened, words as they are."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        items = [shown(x) for x in v]
        return ", ".join(items[:6] + (["..."] if len(items) > 6 else []))
    return str(v)


def _differs(f: dict) -> str:
    return f"{f['key']}: measured {shown(f['measured'])}, {f['source']} says {shown(f['claimed'])}"


def _check_differs(f: dict) -> str:
    parts = [_differs(v) for v in f["differs"]]
    return "not what it claims to be: " + "; ".join(parts)


MESSAGES = {
    "spec.differs": _differs,
    "spec.unread": lambda f: f"{f['key']}: could not be read ({f.get('why') or 'no reading'}); {f['source']} says {shown(f['claimed'])}",
    "spec.slip": "a spec reader raised: {slip}",
    # the battery's spec check
    "spec.undeclared": ("nothing declared (give --like hf:TYPE or --expect KEY=VALUE), and nothing the block says of itself "
                        "that the card reads (rope_theta, softcap, hidden_act, ...)"),
    "spec.own_claims_too_large": lambda f: (f"the block says {', '.join(f['claims'])} of itself; above 50M parameters "
                                            f"its card is read only for a declaration (--like, --expect)"),
    "spec.reference_unread": lambda f: f"nothing could be read off {f['like']} to hold the block against",
    "spec.matches": lambda f: f"{f['matched']} {'entr' if f.get('own') else 'declared entr'}{'y' if f['matched'] == 1 else 'ies'} "
                              f"{'the block says of itself ' if f.get('own') else ''}match{'es' if f['matched'] == 1 else ''}"
                              + (f" ({f['unread']} could not be read: {', '.join(f['unread_keys'])})" if f["unread"] else ""),
    "spec.not_like": _check_differs,
    "spec.constant_gate": lambda f: ("one expert per token, its weight renormalised over the chosen one: every gate is "
                                     "p / p = 1 whatever the router computes, so the router gets no gradient from the "
                                     "output and routing stays as initialised (top-1 routing keeps the probability, as "
                                     "Switch does; renormalise only over two or more)"),
    "spec.capped_scale": lambda f: (f"under its soft-cap ({f['softcap']:g}) the scores' slope at small logits is "
                                    f"{f['ratio']:.3g}x what 1/sqrt(head dim {f['head_dim']:g}) gives (outside "
                                    f"{f['low']:g}..{f['limit']:.3g}): "
                                    + ("cap * tanh(s) where cap * tanh(s / cap) was meant, or the 1/sqrt(d_head) "
                                       "missing" if f["ratio"] > 1 else "the scores scaled twice")),
    "spec.cap_not_divided": lambda f: (f"under its soft-cap ({f['softcap']:g}) the scores' slope at small logits is "
                                       f"{f['ratio']:.3g}x what 1/sqrt(head dim {f['head_dim']:g}) gives, the cap's own "
                                       f"value: cap * tanh(s) where cap * tanh(s / cap) was meant"),
    "spec.nothing_read": lambda f: f"none of the {f['unread']} declared entries could be read ({', '.join(f['unread_keys'])})",
}

MESSAGES.update({
    "like_reference.undeclared": "no --like layer declared",
    "like_reference.not_compared": lambda f: f"not compared with {f['like']}: {f['why']}",
    "like_reference.same": lambda f: f"computes what {f['like']} computes with the same weights (max rel. diff {f['rel']:.2g})",
    "like_reference.rotary_layout": lambda f: f"{f['like']}'s layer with its rotary pairs laid out the other way (here "
                                    f"{f['rotary']['a']}, there {f['rotary']['b']}): not compared beyond that weight layout; "
                                    f"the spec check reads the rest",
    "like_reference.params_differ": lambda f: (
        f"computes what {f['like']} computes only with parameters set aside: "
        + "; ".join(part for part in (
            f"the block has {', '.join(f['extra'])} that {f['like']} lacks" if f["extra"] else "",
            f"{f['like']} has {', '.join(f['lacking'])} that the block lacks" if f["lacking"] else "") if part)
        + " (zeroed or left at their identity values to compare: a checkpoint of one does not load into the other, "
          "and training moves other parameters)"),
    "like_reference.differs": lambda f: f"differs from {f['like']} with the same weights ({', '.join(f['differ']) or 'a finding'}; max rel. diff "
                              f"{f['rel']:.2g})" + (f"; {f['first']}" if f.get("first") else "")
                              + ("" if f.get("first") or not f.get("findings") else f"; {f['findings'][0]}"),
})

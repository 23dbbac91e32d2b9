"""Checks that conventional names agree with what the dataflow says each projection does."""

from __future__ import annotations

from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, passed, skipped, warned

# Conventional projection names (the last part of a module or parameter name) -> the roles they promise. Names
# used for several roles across codebases (c_proj, dense, wo, fc1, w1) are left out, so a match is a promise.
NAME_ROLES = {
    # a bare `gate` is left out: mixture-of-experts layers call their router that
    **dict.fromkeys(("gate_proj", "w_gate", "gate_linear", "wi_0"), ("ffn.gate",)),
    **dict.fromkeys(("up_proj", "up", "w_up", "w3", "wi_1"), ("ffn.in",)),
    **dict.fromkeys(("down_proj", "down", "w_down", "w2"), ("ffn.out",)),
    **dict.fromkeys(("q_proj", "query", "wq", "to_q"), ("attn.q", "attn.qk", "attn.qkv")),
    **dict.fromkeys(("k_proj", "key", "wk", "to_k"), ("attn.k", "attn.qk", "attn.kv", "attn.qkv")),
    **dict.fromkeys(("v_proj", "value", "wv", "to_v"), ("attn.v", "attn.kv", "attn.qkv")),
    **dict.fromkeys(("o_proj", "out_proj"), ("attn.out",)),
}
JUDGED = ("attn.", "ffn.")  # roles the dataflow is sure of; "other" and "norm" promise nothing


def check_names(ctx: Context) -> Outcome:
    """Catches: conventional names that contradict dataflow roles (gate/up/down, q/k/v/o, w2/w3, wq/wk/wv): a
    **warning** naming both (a down projection inside a longer FFN chain, a latent MoE's experts between a pre and a
    post projection, is its inner FFN's output); a gated FFN whose activation follows the product (`act(gate * up)`):
    a **warning**"""
    flow = ctx.dataflow()
    if flow.act_after_product:
        pairs = [list(p) for p in flow.act_after_product]
        return warned("names.act_after_product", ", ".join("*".join(p) for p in pairs), pairs=pairs)
    gated = any(m.role == "ffn.gate" for m in flow.modules)
    # q, k and v read off a product no softmax follows (linear attention: k.v first, then q) are guesses, not roles
    guessed = {n for c in flow.attention if c.scale_note.kind == "no_softmax" for n in c.q + c.k + c.v}
    named = []
    for m in flow.modules:
        promised = NAME_ROLES.get(m.name.rsplit(".", 1)[-1].lower())
        if promised is None or not m.role.startswith(JUDGED) or (m.role.startswith("attn.") and m.name in guessed):
            continue
        if m.role.split(".")[0] != promised[0].split(".")[0]:
            # a name of the other sublayer (mamba's out_proj read as an FFN output): the block is not the attention +
            # FFN the names come from, so they promise nothing here; swaps happen inside one sublayer
            continue
        if promised[0].startswith("ffn.") and not gated:
            continue  # gate/up/down promise roles only a gated FFN has; an ungated one is judged by its chain alone
        named.append(m.name)
        if m.role == "ffn.in" and promised == ("ffn.out",) and m.name in flow.ffn_middles:
            continue  # the output of a nested FFN (experts between a pre and a post projection) that another one reads
        if m.role not in promised:
            wrong = [{"name": m.name, "role": m.role, "promised": promised[0]}]
            others = [{"name": o.name, "role": o.role} for o in flow.modules if o.role in promised and o.name != m.name]
            return warned("names.contradict", m.name, wrong=wrong, holders=others)
    if not named:
        return skipped("names.none")
    return passed("names.agree", len(named), names=named)

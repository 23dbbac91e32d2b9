"""The sentence of every `compare` finding, by kind, from its facts."""

from __future__ import annotations

# What each captured component is, in words (localise.COMPONENTS).
COMPONENT_WORDS = {
    "norm": "norm output", "attn.q": "query projection", "attn.k": "key projection", "attn.v": "value projection",
    "attn.q_pos": "queries as attention reads them (after positions)", "attn.k_pos": "keys as attention reads them (after positions)",
    "attn.v_kernel": "values as attention reads them", "attn.weights": "attention weights",
    "attn.output": "attention output (into the out projection)", "attn.out": "attention out projection",
    "ffn.gate": "FFN gate projection", "ffn.in": "FFN in projection", "ffn.hidden": "FFN hidden state (activation and gating, into the down projection)",
    "ffn.out": "FFN output",
}


def component(key: str) -> str:
    """'attn.k_pos#0' -> 'keys as attention reads them (after positions)' (+ ' #2' past the first)."""
    name, _, k = key.partition("#")
    return COMPONENT_WORDS.get(name, name) + (f" #{int(k) + 1}" if k and k != "0" else "")


def first_difference(f: dict) -> str:
    if "fused_order" in f:
        o = f["fused_order"]
        out = (f"first difference: fused q/k/v split in order {o['order']} ({o['side']}'s {', '.join(o['params'])}): with "
               f"its rows taken in that order the outputs agree")
        return out + (f"; as carried, {component(f['component'])} ({f['component']}) differs first" if "component" in f else "")
    if f.get("path") == "decode":
        lo, hi = f["positions"]
        where = f"position {lo}" if lo == hi else f"positions {lo}..{hi} (the prompt)"
        out = f"first difference on the cached path only: decode step {f['step']} ({where})"
        if "component" in f:
            out += f", at {component(f['component'])} ({f['component']})"
        return out + f", max |A - B| {f['max_abs']:.3g} (relative {f['rel']:.3g}); the full forward agrees"
    out = f"first difference: {component(f['component'])} ({f['component']}), max |A - B| {f['max_abs']:.3g} (relative {f['rel']:.3g})"
    if "heads_permutation" in f:
        out += f"; B's heads are A's permuted: B head j = A head {f['heads_permutation']}[j]"
        if f["component"].startswith(("attn.k", "attn.v")):
            out += " (a GQA head tiling: repeat where repeat_interleave is meant, or the reverse)"
    if "rotary" in f:
        out += (f"; A rotates {f['rotary']['a']} feature pairs, B {f['rotary']['b']} ones: the Meta <-> HF rotary "
                f"layout, fixed by permuting the q/k rows of the checkpoint")
    return out


def compile_graph_breaks(f: dict) -> str:
    head = f"{f['count']} graph break(s), {f['graphs']} graph(s)"
    if f["graphs"] > f["count"] + 1:  # breaks without a reason: frame boundaries of the code around the block
        head += f" ({f['graphs'] - f['count'] - 1} split where the code around the block calls it, not counted)"
    return head + "".join(f"\n  {r['reason']}" + (f" at {r['where']}" if r.get("where") else "") for r in f["reasons"])


def compile_recompiles(f: dict) -> str:
    steps = ", ".join(f"seq {r['seq']}: {r['new_graphs']} new graph(s)" for r in f["recompiles"])
    return f"recompilation as the sequence length changes: {steps}; train mode compiled {f['train_graphs']} graph(s) of its own"


MESSAGES = {
    "compare.equal": lambda f: f"A and B agree on {', '.join(f['what'])} (relative tolerance {f['tol']:.0e})",
    "compare.differ": lambda f: f"A and B differ: {', '.join(f['what'])}",
    "compare.first_difference": first_difference,
    "compare.not_localised": "no captured role output differs ({captured} compared): the difference is between them "
                             "(a residual, a scale, the mask)",
    "compare.builtin_follows": lambda f: f"the built-in side ({f['side']}) follows the other side's declared layout: "
                                         + ", ".join(f"{k} {v}" for k, v in f.items() if k != "side"),
    "mapping.carried": "weights carried A -> B: {name} by name, {role} by dataflow role, {map} by --map",
    "mapping.name_role": "A's {a} is {a_role} but B's {b} is {b_role}: the same name does a different job "
                         "(a checkpoint loaded by name would hit this)",
    "mapping.bias_zeroed": lambda f: (f"{f['side']}'s {f['param']} has no counterpart on the other side: set to zero for the "
                                      f"comparison" + (" (given random values, it changes nothing)" if f.get("inert") else "")),
    "mapping.at_init": "{side}'s {param} has no counterpart on the other side: left at its init ({value}, where it "
                       "computes the identity); the comparison holds for that value only",
    "compile.no_compiler": "no C++ compiler found (g++, clang++, cc): inductor cannot build CPU kernels; compared against "
                           "the {backend} backend instead",
    "compile.failed": "torch.compile failed: {error}",
    "compile.graph_breaks": compile_graph_breaks,
    "compile.recompiles": compile_recompiles,
    "compile.equal": "compiled ({backend}) equals eager: outputs {outputs:.2g}, input grad {input_grad:.2g}, "
                     "parameter grads {param_grads:.2g} (relative; tolerance {tolerance:.0e})",
    "compile.differ": "compiled ({backend}) differs from eager: outputs {outputs:.2g}, input grad {input_grad:.2g}, "
                      "parameter grads {param_grads:.2g} (relative; tolerance {tolerance:.0e})",
}

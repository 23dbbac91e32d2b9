"""The sentence of every check outcome, by kind, from its facts."""

from __future__ import annotations

from tblock_cli.messages.words import layer_prefix, names, shape, span
from tblock_cli.units import fmt_bytes

NEED_REASON = {
    "shape": "needs an output of the input's shape (see shape)",
    "finite": "outputs not finite (see finite)",
    "deterministic": "outputs random in eval (see determinism): two forwards cannot be compared",
    "input_kept": "the forward changes its input in place (see input_unchanged): gradients through it are unreliable",
    "independent": "samples leak into each other (see batch): a sample alone cannot be compared with its padded batch",
}


def _finite(f: dict) -> str:
    parts = [f"{b['input']} input gives {b['got']}" for b in f["inputs"]]
    parts += [f"{n['name']} ({n['type']}, eps={n['eps']:g}) gives NaN on a zero-variance input" for n in f["norms"]]
    return "; ".join(parts)


def _grad_params_ok(f: dict) -> str:
    note = f"; exactly zero (can be legitimate, e.g. a key bias): {names(f['zero'])}" if f["zero"] else ""
    return f"every trainable parameter gets a finite gradient{note}"


def _fully_padded(f: dict) -> str:
    if f.get("fully_padded") == "raises":
        return f"a fully padded sequence raises {f['fully_padded_error']}"
    return f"a fully padded row gives {f['fully_padded']} (eval)"


def _padding_respected(f: dict) -> str:
    sides = "right and left padding" if len(f["sides"]) == 2 else "right padding"
    notes = "".join(f"; {n['side']} padding gives {n['got']} at real positions (fully masked pad rows spread); not compared"
                    for n in f["nonfinite"])
    return f"padded inputs reach no real output; {sides} = tokens run alone (max {f['diff']:.1e}); {_fully_padded(f)}{notes}"


def _padding_differs(f: dict) -> str:
    why = ("the causal block ignores its mask (pads before a token reach it)" if f["side"] == "left" else
           "real tokens do not attend as they do alone: mask polarity (--pad-means keep?) or masked queries zeroed")
    return f"with {f['side']} padding, real positions differ from the same tokens run alone by {f['diff']:.2e}: {why}"


def _calls(f: dict) -> str:
    """Per attention call, or ranges over a stack's calls."""
    calls = f["calls"]
    if len(calls) > 3:
        ratios = [c["scale_ratio"] for c in calls if c["scale_ratio"] is not None]
        return (f"{len(calls)} attention calls: logit std {span([c['logit_std'] for c in calls], '.3f')}, entropy "
                f"{span([c['entropy'] for c in calls], '.2f')} of uniform, max p {span([c['max_prob'] for c in calls], '.2f')}"
                + (f", scale x{span(ratios, '.2f')}" if ratios else ""))
    return "; ".join(f"{c['where']} ({c['kind']}, d_head {c['head_dim']}): logit std {c['logit_std']:.3f}, entropy "
                     f"{c['entropy']:.2f} of uniform, max p {c['max_prob']:.2f}"
                     + ("" if c["scale_ratio"] is None else f", scale x{c['scale_ratio']:.2f}") for c in calls)


def _ffn_share(f: dict) -> str:
    rule = "the 2/3 rule" if abs(f["predicted"] - 2 / 3) < 5e-4 else f"FFN/attention matrices = {f['matrix_ratio']:.2f}, not 2"
    return (f"FFN share by dataflow roles; matrices predict {f['predicted']:.1%} ({rule}); biases and norms "
            f"{(f['share'] - f['predicted']) * 100:+.1f} pt")


MESSAGES = {
    **{f"needs.{need}": reason for need, reason in NEED_REASON.items()},
    "error.raised": "{error}",
    # shape
    "shape.kept": "output keeps the input's shape (B, T, d) and dtype",
    "shape.changed": lambda f: f"input {shape(f['input'])} came out as {shape(f['output'])}",
    "shape.upcast": lambda f: (f"shape kept, but a {f['input_dtype']} input came out as {f['output_dtype']}: something upcasts "
                               f"(a float64 constant? a softmax kept in float32?), and every later layer pays for it"),
    "shape.downcast": lambda f: (f"shape kept, but a {f['input_dtype']} input came out as {f['output_dtype']}: something "
                                 f"downcasts (a .half() or an autocast inside?), and the caller loses precision"),
    # finite
    "finite.ok": lambda f: f"outputs finite on {names(f['inputs'])} inputs",
    "finite.nonfinite": _finite,
    # determinism
    "determinism.identical": "two eval forwards are bit-identical",
    "determinism.rounding": "two eval forwards differ by {diff:.1e}, within rounding: non-deterministic kernels",
    "determinism.random": "two eval forwards differ by {diff:.2e}: randomness in eval (dropout left on? F.dropout(training=True)?)",
    # input_unchanged
    "input_unchanged.kept": "caller's tensor unchanged by eval and train forwards",
    "input_unchanged.eval": "an eval forward changed the caller's tensor in place",
    "input_unchanged.train": "a train forward changed the caller's tensor in place",
    # grad_input, grad_params
    "grad_input.ok": "a loss's gradient reaches x: finite, non-zero (value: its norm)",
    "grad_input.none": "no gradient reaches x: the output is cut off from the input (detach? no_grad?)",
    "grad_input.nonfinite": "the gradient at x is not finite",
    "grad_input.zero": "the gradient at x is exactly zero",
    "grad_params.no_params": "the block has no trainable parameters",
    "grad_params.missing": lambda f: f"no gradient (defined but unused, or run under no_grad): {names(f['params'])}",
    "grad_params.nonfinite": lambda f: f"non-finite gradient: {names(f['params'])}",
    "grad_params.ok": _grad_params_ok,
    # residual
    "residual.present": lambda f: (f"tr(J)/n = {', '.join(f'{g:.3f}' for g in f['gains'])}: identity path present "
                                   f"(Pre-LN ~1, Post-LN ~0.9, none ~0)"),
    "residual.missing": lambda f: (f"{layer_prefix(f['layer'])}tr(J)/n = {f['gain']:.3f} < {f['limit']}: no identity path from "
                                   f"input to output (missing x + ...?)"),
    "residual.doubled": lambda f: (f"{layer_prefix(f['layer'])}tr(J)/n = {f['gain']:.3f} > {f['limit']}: the identity path is "
                                   f"counted more than once (x + x + f(x)?)"),
    "residual.after_norm": ("doubling the input changes the output by {change:.1e} only: every path from the input starts at "
                            "a norm, so the residual adds LN(x), not x"),
    # batch
    "batch.independent": "a sample alone = its output in the batch (max rel. diff {diff:.1e}); no cross-sample gradient",
    "batch.leak": "a sample alone differs from itself in the batch by {diff:.2e} (> {limit:g}): samples leak (eval)",
    "batch.leak_train": "in train mode sample 0's output has gradient {gradient:.2e} w.r.t. other samples: samples leak",
    # padding
    "padding.no_keyword": ("the forward takes none of pad_mask, key_padding_mask, src_key_padding_mask, padding_mask "
                           "(name yours with --pad-keyword)"),
    "padding.ignored": lambda f: (f"changing padded inputs moved real outputs by {f['diff']:.2e}: the mask is ignored or "
                                  f"inverted; {_fully_padded(f)}"),
    "padding.gradient": lambda f: f"in train mode real outputs have a gradient w.r.t. padded inputs; {_fully_padded(f)}",
    "padding.differs_alone": _padding_differs,
    "padding.respected": _padding_respected,
    # causal
    "causal.not_asked": lambda f: ("not asked for (--causal); " + ("outputs ignore later positions already"
                                                                    if f["causal_by_itself"] else "outputs depend on later positions")),
    "causal.leak": "changing positions after t={t} moved outputs up to t by {diff:.2e}: the future leaks",
    "causal.leak_train": "in train mode outputs up to t={t} have a gradient w.r.t. later positions: the future leaks",
    "causal.respected": "outputs up to t ignore inputs after t (values and gradients)",
    # order
    "order.causal": "--causal: token order is the point",
    "order.positional": lambda f: ("--positional declared" if f.get("declared") else f"position machinery found ({f['found']})")
    + ": token order matters by design",
    "order.causal_by_itself": "the block is causal by itself (outputs ignore later positions): token order is the point",
    "order.scrambled": ("permuting the tokens changed the outputs by {diff:.2e}, not just their order: positions are scrambled "
                        "(heads merged without transposing back? a roll or shift?) or the block has positions inside (RoPE, "
                        "ALiBi, relative bias): then declare --positional"),
    "order.equivariant": "permuted tokens in, the same outputs permuted out (no positions inside, none scrambled)",
    # train_eval
    "train_eval.random_train": ("two train forwards differ with every dropout zeroed (a functional dropout with a fixed p?): "
                                "nothing to compare"),
    "train_eval.differs": ("with every dropout zeroed, train mode differs from eval by {diff:.2e}: the block computes another "
                           "function in eval (an `if not self.training` path?)"),
    "train_eval.agree": "with dropout zeroed, train and eval forwards agree",
    # attention
    "attention.none": "no attention computation seen (nn.MultiheadAttention, SDPA, or a softmax over a product of activations)",
    "attention.stats": _calls,
    "attention.query_axis": lambda f: (f"softmax over the query axis in {f['where']}: each key's weights sum to 1, not each "
                                       f"query's (softmax(dim=-2)?); {_calls(f)}"),
    "attention.no_softmax": lambda f: (f"no softmax in {f['where']}: a q.k product weights the values directly (rows not "
                                       f"non-negative summing to 1; linear attention does this by design); {_calls(f)}"),
    "attention.self_masked": lambda f: (f"no token attends to itself in {f['where']}: the diagonal of the scores is masked (a "
                                        f"causal mask from triu(0) instead of triu(1)?); {_calls(f)}"),
    "attention.overscaled": lambda f: (f"scores scaled more than 1/sqrt(d_head) in {f['where']}: logit std is {f['ratio']:.2f}x "
                                       f"what q.k/sqrt(d_head) predicts (1/sqrt(d_model) gives 1/sqrt(n_heads); the scale applied "
                                       f"twice gives 1/sqrt(d_head); muP's 1/d_head is deliberate); {_calls(f)}"),
    "attention.unscaled": lambda f: (f"scores look unscaled in {f['where']}: logit std is {f['ratio']:.2f}x what q.k/sqrt(d_head) "
                                     f"predicts from {f['note']} (sqrt(d_head) = {f['head_dim'] ** 0.5:.2f} if the 1/sqrt(d_head) "
                                     f"is missing); {_calls(f)}"),
    # kv_cache
    "kv_cache.not_causal": "not asked for (--causal): cached decoding is for causal blocks",
    "kv_cache.no_decode": "the block has no decode(x_t, cache) -> (y_t, cache) method (see docs/decoding.md)",
    "kv_cache.shape": lambda f: f"{f['split']}: decoded outputs have shape {shape(f['got'])}, the forward {shape(f['expected'])}",
    "kv_cache.differs": ("{split}: position {position} differs from the full causal forward by {diff:.2e} (worst {worst:.2e}): "
                         "the cache or the positions are wrong"),
    "kv_cache.graph": "{split}: a no_grad decode returned {tensors} tensor(s) with a grad_fn: an autograd graph grows across steps",
    "kv_cache.shared": "two sequences decoded in turns differ from each decoded alone by {diff:.2e}: the caches share state",
    "kv_cache.equal": lambda f: (f"prefill + one token at a time and chunks of 3 equal the full causal forward (max "
                                 f"{f['worst']:.1e}); no grad_fn under no_grad; two caches independent; cache "
                                 f"{fmt_bytes(f['bytes'])} at {f['positions']} positions"),
    # norm_placement
    "norm_placement.no_norms": "no norm of the residual stream found: nothing to place",
    "norm_placement.no_sublayers": "no attention and no FFN found",
    "norm_placement.ffn_unnormed": lambda f: (f"the FFN ({names(f['modules'])}) reads the residual stream with no norm before it, "
                                              f"though the block has norms (a Pre-LN block missing its second norm, or a Post-LN "
                                              f"block missing its first)"),
    "norm_placement.split_kv": lambda f: (f"keys/values ({names(f['modules'])}) read the un-normalised stream while their "
                                          f"queries read the normalised one: the norm applied to the queries only (attn(LN(x), x, x)?)"),
    "norm_placement.attention_unnormed": lambda f: (f"attention ({names(f['modules'])}) reads the un-normalised stream and no "
                                                    f"norm follows the residual add, while the FFN reads a normalised one: a "
                                                    f"Pre-LN block missing its first norm, or Post-LN and Pre-LN mixed"),
    "norm_placement.post": "Post-LN: the output comes from a norm",
    "norm_placement.pre": "every sublayer reads a normalised stream",
    # need_weights
    "need_weights.no_mha": "no nn.MultiheadAttention inside; need_weights is its option",
    "need_weights.not_called": "no nn.MultiheadAttention was called in the forward",
    "need_weights.on": lambda f: (f"{names(f['modules'])} called with need_weights=True: {fmt_bytes(f['bytes'])} of attention "
                                  f"weights computed and thrown away per forward; pass need_weights=False"),
    "need_weights.off": "{calls} nn.MultiheadAttention call(s), all need_weights=False",
    # dtype
    "dtype.nonfinite": lambda f: (f"{f['dtype']} output is not finite where float64 is" if f["reference_finite"]
                                  else "not finite in float64 either"),
    "dtype.differs": "{dtype} differs from a float64 copy by relative RMS {error:.2e} > {limit:g}",
    "dtype.agrees": "{dtype} vs a float64 copy: relative RMS error (limit {limit:g})",
    # ffn_share
    "ffn_share.no_ffn": "no FFN found in the dataflow (a projection consuming another's output, outside attention)",
    "ffn_share.no_attention": "no attention found in the dataflow: the share has nothing to compare with",
    "ffn_share.measured": _ffn_share,
    "ffn_share.linear": lambda f: ("; ".join(f"`{a}` and `{b}` compose to one linear map" for a, b in f["chains"])
                                   + f": no nonlinearity between the FFN's projections; {_ffn_share(f)}"),
    "ffn_share.other": lambda f: f"{_ffn_share(f)}; {f['other']:.1%} of parameters sit outside attention, FFN and norms",
    # reference
    "reference.user_block": "needs the built-in block's structure; a user block has no reference",
    "reference.differs": "differs from nn.TransformerEncoderLayer with the same weights by {diff:.2e} (> {limit:g}, float32)",
    "reference.equal": "max |diff| to nn.TransformerEncoderLayer with copied weights (float32, eval)",
}


# ----------------------------------------------------------------------------- past one device (distributed/)
def _tp_where(f: dict) -> str:
    first = f.get("first_module")
    if not first:
        return ""
    if f.get("role") == "attn.out":
        return (f"; the first module whose output differs is `{first}` (attn.out): the attention feeding it computes "
                f"something else on each rank's heads: heads split with the global head count (view(B, T, n_heads, -1)) "
                f"instead of view(B, T, -1, head_dim), or a norm over the full q/k width applied to each rank's slice")
    if f.get("role") == "ffn.out":
        return (f"; the first module whose output differs is `{first}` (ffn.out): something between the FFN's "
                f"column-sharded projections and it needs all the hidden units (a norm or sum over the hidden width?)")
    return f"; the first module whose output differs is `{first}`" + (f" ({f['role']})" if f.get("role") else "")


def _tp_raised(f: dict) -> str:
    where = f"`{f['where']}`" + (f" ({f['role']})" if f.get("role") else "") if f.get("where") else "the forward"
    return (f"rank {f['rank']}: {where} raised under --tp {f['ranks']}: {f['error']}; a module that needs the full "
            f"width of a column-sharded activation (a norm over q's full width, a reshape to the global width?)")


_DIST = {
    "tensor_parallel.off": "run with --tp N to check the block tensor-parallel",
    "tensor_parallel.equal": lambda f: (f"--tp {f['ranks']} ({len(f['colwise'])} colwise, {len(f['rowwise'])} rowwise): outputs, "
                                        f"input and parameter gradients equal the unsharded block's (max relative diff, limit {f['limit']:g})"),
    "tensor_parallel.differs": lambda f: (f"--tp {f['ranks']}: the sharded block differs from the unsharded one with the same weights: "
                                          f"output {f['output']:.2e}, input grad {f['input_grad']:.2e}, parameter grad "
                                          f"{f['param_grad']:.2e} (worst {f['worst_param']}; limit {f['limit']:g}){_tp_where(f)}"),
    "tensor_parallel.raised": _tp_raised,
    "fsdp.off": "run with --fsdp N to check the block under FSDP2",
    "fsdp.equal": lambda f: (f"--fsdp {f['ranks']}: per-rank micro-batches give the whole batch's averaged gradients and the same "
                             f"parameters after an SGD step (max relative diff, limit {f['limit']:g})"),
    "fsdp.differs": lambda f: (f"--fsdp {f['ranks']}: differs from one process on the whole batch of {f['batch']}: output "
                               f"{f['output']:.2e}, input grad {f['input_grad']:.2e}, parameter grad {f['param_grad']:.2e} "
                               f"(worst {f['worst_param']}), after a step {f['step']:.2e} (limit {f['limit']:g})"
                               + ("" if f["param_grad"] != float("inf") else
                                  f"; `{f['worst_param']}` gets no gradient under fully_shard: the forward uses a reference "
                                  f"to it kept outside the module (a list, a closure), not the parameter FSDP gathers")),
    "fsdp.raised": lambda f: (f"rank {f['rank']}: " + (f"`{f['where']}` " if f.get("where") else "the forward ")
                              + f"raised under fully_shard: {f['error']}"),
}
MESSAGES.update(_DIST)

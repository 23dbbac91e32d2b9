"""The sentence of every check outcome, by kind, from its facts."""

from __future__ import annotations

from tblock_cli.messages.units import fmt_bytes
from tblock_cli.messages.words import layer_prefix, names, of_update, shape, span

NEED_REASON = {
    "shape": "needs an output of the input's shape (see shape)", "finite": "outputs not finite (see finite)",
    "deterministic": "outputs random in eval (see determinism): two forwards cannot be compared",
    "input_kept": "the forward changes its input in place (see input_unchanged): gradients through it are unreliable",
    "independent": "samples leak into each other (see batch): a sample alone cannot be compared with its padded batch",
    "train_safe": "a second training step fails (see train_state): train mode cannot be probed again",
    "copyable": "a deepcopy of the block is not faithful (see copy): a copy would not compute what the block does",
}


def _finite(f: dict) -> str:
    parts = [f"{b['input']} input gives {b['got']}" for b in f["inputs"]]
    parts += [f"{n['name']} ({n['type']}, eps={n['eps']:g}) gives NaN on a zero-variance input" for n in f["norms"]]
    return "; ".join(parts)


# what sums to 1 under a softmax over another axis than the keys
_WRONG_AXIS = {"query": "each key's weights over the queries", "head": "each query-key pair's weights over the heads",
               "batch": "each position's weights over the batch's samples"}


def _fully_padded(f: dict) -> str:
    if f.get("fully_padded") == "raises":
        return f"a fully padded sequence raises {f['fully_padded_error']}"
    return f"a fully padded row gives {f['fully_padded']} (eval)"


def _padding_respected(f: dict) -> str:
    sides = "right and left padding" if len(f["sides"]) == 2 else "right padding"
    notes = "".join(f"; {n['side']} padding gives {n['got']} at real positions "
                    + ("after a second pass (PyTorch's NaN at fully masked pad rows spreads: nn.MultiheadAttention, "
                       "sdpa before torch 2.5)" if n.get("twice")
                       else "(fully masked pad rows spread); not compared") for n in f["nonfinite"])
    return f"padded inputs reach no real output; {sides} = tokens run alone (max {f['diff']:.1e}); {_fully_padded(f)}{notes}"


def _padding_differs(f: dict) -> str:
    by = f"{f['diff']:.2e}{of_update(f)}"
    if f["side"] == "left" and f.get("positional"):
        why = ("positions inside are not derived from the mask (absolute position ids that do not restart at the first "
               "real token), or the relative scheme is broken (a rotary cos/sin layout that does not match its rotation, "
               "values rotated and never rotated back), or the mask is ignored")
        return f"with left padding, real positions differ from the same tokens run alone by {by}: {why}"
    why = ("the causal block ignores its mask (pads before a token reach it)" if f["side"] == "left" else
           "real tokens do not attend as they do alone: mask polarity (--pad-means keep?) or masked queries zeroed")
    return f"with {f['side']} padding, real positions differ from the same tokens run alone by {by}: {why}"


def _said_causal(f: dict) -> str:
    """Where the block, run without --causal, says it is causal."""
    return f" (not asked for with --causal: the block says it is causal, its {f['claimed']})" if f.get("claimed") else ""


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
    rule = ("the 2/3 rule" if abs(f["predicted"] - 2 / 3) < 5e-4 else
            "no weight matrix of attention's found: its projections are computed outside torch's calls or unrecognised"
            if f["matrix_ratio"] is None else f"FFN/attention matrices = {f['matrix_ratio']:.2f}, not 2")
    return (f"FFN share by dataflow roles; matrices predict {f['predicted']:.1%} ({rule}); biases and norms "
            f"{(f['share'] - f['predicted']) * 100:+.1f} pt")


def _slopes(values) -> str:
    return ", ".join(f"{m:.4g}" for m in values)


MESSAGES = {
    **{f"needs.{need}": reason for need, reason in NEED_REASON.items()},
    "needs.raised": "{check} raised ({error}): what this check builds on is not known",
    "needs.backward": "the block's backward does not run on this device ({error}): its gradients are not judged here",
    "error.raised": "{error}",
    # a family's rule broken on purpose (hf:TYPE): the reason its loader knows
    "by_design": "{reason}", "by_design.skip": "{reason}",
    # shape
    "shape.kept": "output keeps the input's shape (B, T, d) and dtype, also for one token",
    "shape.one_token": lambda f: (f"a one-token input {shape(f['input'])} came out as {shape(f['output'])} (a squeeze() that "
                                  f"drops the length?)"),
    "shape.one_token_raises": "a one-token sequence raises: {error}",
    "shape.fixed_length": "output keeps the input's shape; {seq} tokens only, one more or one token raise: {error}",
    "shape.changed": lambda f: f"input {shape(f['input'])} came out as {shape(f['output'])}",
    "shape.upcast": lambda f: (f"shape kept, but a {f['input_dtype']} input came out as {f['output_dtype']}: something upcasts "
                               f"(a float64 constant? a softmax kept in float32?), and every later layer pays for it"),
    "shape.float64": lambda f: (f"shape kept, but a {f['input_dtype']} input came out as float64: something computes in "
                                f"float64 (a NumPy table? torch.from_numpy keeps float64), every op after it runs at "
                                f"float64's cost, and the next layer's {f['input_dtype']} weights refuse it"),
    "shape.downcast": lambda f: (f"shape kept, but a {f['input_dtype']} input came out as {f['output_dtype']}: something "
                                 f"downcasts (a .half() or an autocast inside?), and the caller loses precision"),
    # finite
    "finite.ok": lambda f: (f"outputs finite on {names(f['inputs'])} inputs"
                            + (f", gradients on {names(f['gradients'])}" if f.get("gradients") else "")),
    "finite.nonfinite": _finite,
    "finite.gradient": lambda f: ("outputs finite, but the gradient at the input is not: "
                                  + "; ".join(f"{b['input']} input gives {b['got']}" for b in f["inputs"])
                                  + " (a derivative infinite where the output is finite: a sqrt or a std at zero, "
                                    "`x / (sqrt(mean x^2) + eps)`; a padding token's zero embedding then turns every "
                                    "weight's gradient to NaN)"),
    # determinism
    "determinism.identical": "two eval forwards are bit-identical",
    "determinism.rounding": "two eval forwards differ by {diff:.1e}, within rounding: non-deterministic kernels",
    "determinism.random": "two eval forwards differ by {diff:.2e}: randomness in eval (dropout left on? F.dropout(training=True)?)",
    # input_unchanged
    "input_unchanged.kept": "caller's tensor unchanged by eval and train forwards",
    "input_unchanged.eval": "an eval forward changed the caller's tensor in place",
    "input_unchanged.train": "a train forward changed the caller's tensor in place",
    "input_unchanged.parameters": lambda f: (f"the caller's tensor is kept, but the battery's forwards wrote parameters "
                                             f"in place ({names(f['parameters'])}): a clamp or normalisation of the "
                                             f"weights kept in the forward changes what an optimizer holds behind its "
                                             f"back"),
    # grad_input, grad_params
    "grad_input.ok": "a loss's gradient reaches x: finite, non-zero (value: its norm)",
    "grad_input.none": "no gradient reaches x: the output is cut off from the input (detach? no_grad?)",
    "grad_input.nonfinite": "the gradient at x is not finite",
    "grad_input.zero": "the gradient at x is exactly zero",
    # residual
    "residual.not_linear": lambda f: (f"at {f['scale']:g}x the input the output is not a multiple of it (misfit "
                                      f"{f['misfit']:.2g}, limit {f['limit']:g}) though every sublayer reads a normalised "
                                      f"stream: something nonlinear acts on the residual stream itself (an activation "
                                      f"after the add?)"),
    "residual.present": lambda f: (f"tr(J)/n = {', '.join(f'{g:.3f}' for g in f['gains'])}: identity path present "
                                   f"(Pre-LN ~1, Post-LN ~0.9, none ~0)"),
    "residual.missing": lambda f: (f"{layer_prefix(f['layer'])}tr(J)/n = {f['gain']:.3f} < {f['limit']}: no identity path from "
                                   f"input to output (missing x + ...?)"),
    "residual.sphere": lambda f: (f"tr(J)/n = {f['gain']:.3f} at an output gain of {f['scale']:.3f} (every output token of one "
                                  f"norm): {f['per_gain']:.3f} per unit of gain, identity path present"),
    "residual.doubled": lambda f: (f"{layer_prefix(f['layer'])}tr(J)/n = {f['gain']:.3f} > {f['limit']}: the identity path is "
                                   f"counted more than once (x + x + f(x)?)"),
    "residual.after_norm": ("doubling the input changes the output by {change:.1e} only: every path from the input starts at "
                            "a norm, so the residual adds LN(x), not x"),
    # padding
    "padding.no_keyword": ("the forward takes none of pad_mask, key_padding_mask, src_key_padding_mask, padding_mask "
                           "(name yours with --pad-keyword)"),
    "padding.hf_no_mask": "its model's forward takes no attention mask (every position is real): nothing to pad",
    "padding.ignored": lambda f: (f"changing padded inputs moved real outputs by {f['diff']:.2e}: the mask is ignored or "
                                  f"inverted; {_fully_padded(f)}"),
    "padding.gradient": lambda f: f"in train mode real outputs have a gradient w.r.t. padded inputs; {_fully_padded(f)}",
    "padding.differs_alone": _padding_differs, "padding.respected": _padding_respected,
    # causal
    "causal.said_bidirectional": lambda f: (f"built bidirectional ({f['said']}), the block is exactly causal: no output reads "
                                            f"a later position (the argument ignored, or a mask or window one-sided)"),
    "causal.not_asked": lambda f: ("not asked for (--causal); " + ("outputs ignore later positions already"
                                                                    if f["causal_by_itself"] else "outputs depend on later positions")),
    "causal.leak": lambda f: (f"changing positions after t={f['t']} moved outputs up to t by {f['diff']:.2e}: the future "
                              f"leaks" + _said_causal(f)),
    "causal.leak_train": lambda f: (f"in train mode outputs up to t={f['t']} have a gradient w.r.t. later positions: the "
                                    f"future leaks" + _said_causal(f)),
    "causal.prefix": lambda f: (f"the first {f['t'] + 1} token(s) run alone give other outputs than the same positions of "
                                f"the whole sequence ({f['diff']:.2e}{of_update(f)}): something reads the sequence's length (a scale by "
                                f"T, positions counted from the end, a table or mask cut to the wrong size)" + _said_causal(f)),
    "causal.respected": lambda f: ("outputs up to t ignore inputs after t (values and gradients), and a prefix run alone "
                                   "gives them" + _said_causal(f)),
    # order
    "order.causal": "--causal: token order is the point",
    "order.positional": lambda f: ("--positional declared" if f.get("declared") else
                                   f"attention scores of identical tokens vary with position ({f['scores']}): positions inside"
                                   if f.get("scores") else
                                   f"outputs of identical tokens vary with position ({f['outputs']:.1e}): positions inside"
                                   if f.get("outputs") else f"position machinery found ({f['found']})")
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
    "attention.none": lambda f: ("no attention computation seen (nn.MultiheadAttention, SDPA, or a softmax over a product of "
                                 "activations)" + (f"; the tracer could not record {f['tracing_slips']} torch call(s) "
                                                   f"({'; '.join(f['slip_errors'])}), so it may have missed one"
                                                   if f.get("tracing_slips") else "")),
    "attention.stats": _calls,
    "attention.query_axis": lambda f: (f"softmax over the {f.get('axis', 'query')} axis in {f['where']}: "
                                       f"{_WRONG_AXIS.get(f.get('axis', 'query'), 'the weights over it')} sum to 1, not each "
                                       f"query's weights over the keys (softmax(dim=-1) meant?); {_calls(f)}"),
    "attention.no_softmax": lambda f: (f"no softmax, or one changed after, in {f['where']}: the values' weights come from q.k in rows not "
                                       f"non-negative summing to 1 (a bias added to the probabilities; linear attention by design); {_calls(f)}"),
    "attention.self_masked": lambda f: (f"no token attends to itself in {f['where']}: the diagonal of the scores is masked (a "
                                        f"causal mask from triu(0) instead of triu(1)?); {_calls(f)}"),
    "attention.overflows": lambda f: (f"with its logits driven to {f['logit']:g} (q scaled) the block's own softmax gives "
                                      f"{f['got']}: it exponentiates without subtracting the row maximum (exp(s) / "
                                      f"sum(exp(s)) overflows past 88 in float32, 11 in float16; use torch.softmax or "
                                      f"s - s.amax(-1, keepdim=True))"),
    "attention.saturated": lambda f: (f"attention saturated as built in {f['where']}: entropy {f['entropy']:.2f} of uniform, "
                                      f"largest weight {f['max_prob']:.2f} on average, logit std {f['logit_std']:.3g}: each "
                                      f"query sits on one key, so the softmax passes almost no gradient (q/k weights "
                                      f"initialised far too large, std 1 where ~1/sqrt(d_model) was meant?)"),
    "attention.declared_scale": lambda f: (f"scores scaled as the block says (attn.scale {f['declared']:g}, "
                                           f"{f['source']}): a deliberate scale, judged by `spec`; {_calls(f)}"),
    "attention.reweighted": lambda f: (f"the weights that reach the values in {f['where']} are not the softmax's: still a "
                                       f"distribution, each row in the softmax's order, but their log-spread is "
                                       f"{f['factor']:.3g}x the softmax's (a second softmax over the probabilities flattens "
                                       f"them to ~1/keys; a temperature applied after the softmax); {_calls(f)}"),
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
    "kv_cache.differs": lambda f: (f"{f['split']}: position {f['position']} differs from the full causal forward by "
                                   f"{f['diff']:.2e} (worst {f['worst']:.2e}){of_update(f)}: the cache or the positions are wrong"),
    "kv_cache.graph": "{split}: a no_grad decode returned {tensors} tensor(s) with a grad_fn: an autograd graph grows across steps",
    "kv_cache.shared": ("two sequences decoded in turns differ from the full causal forward by {diff:.2e}, each decoded alone "
                         "equals it: the caches share state"),
    "kv_cache.equal": lambda f: (f"prefill + one token at a time and prefill + chunks of 3 equal the full causal forward (max "
                                 f"{f['worst']:.1e}), decoded in turns with two caches; no grad_fn under no_grad; cache "
                                 f"{fmt_bytes(f['bytes'])} at {f['positions']} positions"),
    # norm_placement
    "norm_placement.sublayer_post": ("every sublayer reads the stream as it is and its output is normalised before the "
                                     "residual add (OLMo-2's placement); the stream itself is not normalised"),
    "norm_placement.no_norms": "no norm of the residual stream found: nothing to place",
    "norm_placement.no_sublayers": "no attention and no FFN found",
    "norm_placement.shared": lambda f: ("one norm module is registered under several names, so the sublayers it serves "
                                        "share one set of gains where the block means one each (`self.ln2 = self.ln1`?): "
                                        + "; ".join(" = ".join(g) for g in f["shared"])),
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
    # ffn_share
    "ffn_share.no_ffn": "no FFN found in the dataflow (a projection consuming another's output, outside attention)",
    "ffn_share.no_attention": "no attention found in the dataflow: the share has nothing to compare with",
    "ffn_share.measured": _ffn_share,
    "ffn_share.linear": lambda f: ("; ".join(f"`{a}` and `{b}` compose to one linear map" for a, b in f["chains"])
                                   + f": no nonlinearity between the FFN's projections; {_ffn_share(f)}"),
    "ffn_share.other": lambda f: f"{_ffn_share(f)}; {f['other']:.1%} of parameters sit outside attention, FFN and norms",
    # reference
    "reference.user_block": "needs the built-in block's structure; a user block has no reference",
    "reference.differs": "differs from nn.TransformerEncoderLayer with the same weights by {diff:.2e} (> {limit:g}, {dtype})",
    "reference.equal": "max |diff| to nn.TransformerEncoderLayer with copied weights ({dtype}, eval)",
    # device
    "device.on_accelerator": "the battery runs on {device} already",
    "device.not_traced": "the training pass raised with tensors followed ({error}): not judged",
    "device.mismatch": lambda f: (f"on a GPU the training pass would raise: `{f['op']}` meets the block's tensors with "
                                  f"CPU tensor(s) of shape {', '.join(str(tuple(s)) for s in f['host_shapes'])} (created "
                                  f"without device=, or a plain tensor attribute .to() does not move)"),
    "device.portable": "a training forward and backward keep every tensor on the side .to(device) puts the block",
}


def _relative(f: dict) -> str:
    where = f"{f['where']} at {f['seq']} tokens"
    long = f"; not probed at length 320 ({f['long_error']})" if f.get("long_error") else ""
    return where + long


def _names_contradict(f: dict) -> str:
    w = f["wrong"][0]
    holders = f"; {names([h['name'] for h in f['holders']])} does ({w['promised']})" if f["holders"] else ""
    return (f"`{w['name']}` is named as {w['promised']} but the dataflow makes it {w['role']}{holders}: the names "
            f"contradict what the modules do (the activation on the wrong projection?), so a checkpoint would load the "
            f"weights the wrong way round")


MESSAGES.update({
    # padding, third generation
    "padding.nan_spreads": lambda f: (f"with {f['side']} padding, padded rows come out non-finite and a second pass "
                                      f"through the block gives {f['got']} at real positions: fully masked rows filled "
                                      f"with -inf give NaN, and two such layers in a row spread it (fill with "
                                      f"finfo.min, or zero those rows); {_fully_padded(f)}"),
    "padding.grad_nonfinite": lambda f: (f"with {f['side']} padding the training forward is finite but a backward of the "
                                         f"real outputs gives non-finite gradients at {names(f['params'])}: rows that see "
                                         f"no real key were filled with -inf and their NaN hidden after the softmax "
                                         f"(nan_to_num, masked_fill): 0 * NaN in the backward (fill with finfo.min); "
                                         f"{_fully_padded(f)}"),
    # copy
    "copy.faithful": "a deepcopy's forward touches none of the original's modules, parameters or buffers",
    "copy.unfaithful": lambda f: (f"deepcopy is not faithful: the copy's forward uses the original's {names(f['shared'])} "
                                  f"(a lambda or closure capturing a submodule?); float64 copies, EMA and per-device "
                                  f"copies would all compute with the original's weights"),
    "copy.raises": "deepcopy of the block raises: {error}",
    "copy.faithful_held": lambda f: ("a deepcopy's forward touches none of the original's modules, parameters or buffers; "
                                     f"{names(f['held'])} kept with the last training forward's graph: a deepcopy taken "
                                     "before the next forward raises on it (copied detached here)"),
    # determinism, third generation
    "determinism.writes_state": lambda f: ("an eval forward repeated on the same input writes module state again, its "
                                            "output unchanged: " + "; ".join(x for x in (
                                                f"adds or drops {names(f['grown'])}" if f["grown"] else "",
                                                f"new values in {names(f['written'])}" if f["written"] else "") if x)
                                            + " (running statistics updated in eval, a list that grows with every call?)"),
    "determinism.adds_hooks": lambda f: ("every eval forward registers hooks that stay: "
                                         + ", ".join(f"{n} more on {k}" for k, n in f["added"].items())
                                         + " per call (a register_*_hook inside forward?): each call runs all the "
                                         "hooks before it, so calls grow slower and what the hooks hold is never freed"),
    "determinism.raised_dropout": ("with its zero dropout probabilities raised to 0.1, two eval forwards differ by {diff:.2e}: "
                                   "dropout is applied in eval (F.dropout(training=True)? a dropout_p passed to SDPA "
                                   "whatever self.training?), hidden while the block is built with dropout 0"),
    # train_eval, third generation
    "train_eval.eval_unused": lambda f: (f"parameters that a train backward reaches and an eval backward never "
                                         f"touches: {names(f['params'])}: eval skips part of the block (an early return "
                                         f"in eval?)"),
    # relative
    "relative.no_attention": "no attention computation seen",
    "relative.absolute": "no attention call whose q and k projections read position-free inputs (absolute positions enter "
                         "before them): not a relative scheme",
    "relative.gains_inside": lambda f: (
        f"with every token identical the scores depend on i - j only as built ({f['error']:.1e}), but not once the "
        f"constant gains and biases are redrawn ({names(f['drawn'])}, each moved by up to 0.5): {f['drawn_where']} then "
        f"deviates by {f['drawn_error']:.1e} (limit {f['limit']:g}): a per-channel gain or bias acts on q or k after "
        f"the rotation (a q/k norm after the rotary embedding, a bias added to rotated queries or keys); trained, it "
        f"breaks relative positions (a mistake, unless the design means it: HunYuan's checkpoints were trained so)"),
    "relative.qk_offset": lambda f: (
        f"q and k are rotated at different positions: with {f['k_proj']} given {f['q_proj']}'s weights, k's rotating "
        f"pairs stand {f['phase']:.2g} rad from q's" + (f", k {f['offset']:+.2f} positions from q" if f.get("offset") is
        not None else "") + ": the scores stay a function of i - j, shifted, and every token attends off by that much"),
    "relative.values_positioned": lambda f: (f"with every token identical, values entering attention in {f['where'] or 'root'} differ by "
                                             f"position, and with each query attending to itself the output rows still differ "
                                             f"by {f['moved']:.2g} (limit {f['limit']:g}): v is rotated and never rotated back"),
    "relative.toeplitz": lambda f: (f"with every token identical the scores depend on i - j only (max deviation "
                                    f"{f['error']:.1e}, limit {f['limit']:g}; {_relative(f)})"),
    "relative.edge": lambda f: (f"with every token identical the scores depend on i - j only from position {f['start']} on "
                                f"(deviation {f['tail']:.1e}, limit {f['limit']:g}); the first positions differ by "
                                f"{f['error']:.1e}: zero padding of something translation-equivariant (a causal "
                                f"convolution), not a position scheme ({_relative(f)})"),
    "relative.grid": lambda f: (f"with every token identical the scores are a function of the 2D offset on a patch grid "
                                f"({'; '.join(str(g['width']) + ' wide after ' + str(g['prefix']) + ' special tokens' for g in f['grids'])}): "
                                f"a 2D position scheme (BEiT's bias, EVA-02's rotary)"),
    "relative.not_toeplitz": lambda f: (f"with every token identical the scores are not a function of i - j (deviation "
                                        f"{f['error']:.2e} > {f['limit']:g}, {_relative(f)}): the relative scheme is "
                                        f"broken (rotary cos/sin laid out for interleaved pairs but a half-split "
                                        f"rotation, or angles computed in half precision?)"),
    # position_bias
    "position_bias.no_attention": "no attention computation seen",
    "position_bias.none": "no additive bias on the q.k scores",
    "position_bias.length": lambda f: (f"the block does not run at {f['seq']} tokens, the length a bias is read over "
                                       f"({f['error']}): a fixed length (a patch grid) or a shorter table; not judged"),
    "position_bias.learned": "an additive bias not linear in distance (a learned relative bias): not judged",
    "position_bias.alibi": lambda f: f"ALiBi bias: slopes {_slopes(f['slopes'])}: geometric, the paper's",
    "position_bias.rises": lambda f: (f"the additive bias grows with distance for some head (slopes "
                                      f"{_slopes(f['slopes'])}): its sign is flipped"),
    "position_bias.not_geometric": lambda f: (f"ALiBi slopes {_slopes(f['slopes'])} are neither one "
                                              f"geometric sequence nor the paper's set (the paper's: "
                                              f"{_slopes(f['expected'])})"),
    "position_bias.not_paper": lambda f: (f"ALiBi slopes {_slopes(f['slopes'])} are geometric (or the paper's set) but "
                                          f"not the paper's {_slopes(f['expected'])} in head order (off by "
                                          f"{f['off']:.0%}): the sequence starts, steps or runs the wrong way"),
    # names
    "names.none": "no projection carries a conventional name (gate/up/down, q/k/v/o, w2/w3 ...)",
    "names.agree": lambda f: f"conventional names agree with dataflow roles: {names(f['names'])}",
    "names.contradict": _names_contradict,
    "names.act_after_product": lambda f: (f"the activation follows the product of {' and '.join(f'`{n}`' for n in f['pairs'][0])}: "
                                          f"act(gate * up), not act(gate) * up"),
})


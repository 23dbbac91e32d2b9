"""The sentence of every bench, depth and params finding, by kind, from its facts."""

from __future__ import annotations

from tblock_cli.messages.units import fmt_bytes

MIB = 2**20
# What one decimal of a percentage point shows: a smaller move of the FFN share is not worth a clause.
SHARE_SHOWN = 5e-4


def _latency(f: dict) -> str:
    """'a is Nx faster than b' only for a difference beyond the noise (the verdict is decided by the report)."""
    a, b, ratio, verdict = f["a"], f["b"], f["ratio"], f["verdict"]
    if verdict == "overlap":
        return f"no measurable latency difference between {a} and {b} (their IQRs overlap)"
    if verdict == "within":
        return f"no meaningful latency difference between {a} and {b} ({ratio:.2f}x: IQRs apart, but within {f['within']:.0%})"
    if verdict == "faster":
        return f"{a} is {ratio:.2f}x faster than {b} (IQRs apart)"
    return f"{a} is {1 / ratio:.2f}x slower than {b} (IQRs apart)"


def _need_weights(f: dict) -> str:
    saved, matrix = f["saved_bytes"], f["matrix_bytes"]
    if f["materialises"]:
        mem = (f"with need_weights=False the kernel ({f['kernel_off']}) still materialises the attention matrix; "
               f"peak memory on - off = {saved / MIB:+.1f} MiB, not the {matrix / MIB:.1f} MiB of a (B, H, L, L) matrix")
    else:
        mem = (f"need_weights=False runs {f['kernel_off']} instead of {f['kernel_on']} and saves "
               f"{saved / MIB:.1f} MiB of peak memory ({f['matrix_fraction']:.2f}x the {matrix / MIB:.1f} MiB (B, H, L, L) matrix)")
    return f"{f['mode']}, seq {f['seq']}: {mem}; {_latency(f['latency'])}"


def _regression(f: dict) -> str:
    what = []
    if f["slower"]:
        what.append(f"{f['ratio']:.2f}x the saved latency, beyond the noise")
    if f["memory_grew"]:
        what.append(f"peak memory {f['memory_delta']:+,} bytes")
    return f"regression at {f['point']}: " + ", ".join(what)


def _inconclusive(f: dict) -> str:
    ratio = "" if f["ratio"] is None else f" ({f['ratio']:.2f}x the saved median)"
    verb = "was" if len(f["noisy"]) == 1 else "were"
    return (f"inconclusive at {f['point']}{ratio}: {' and '.join(f['noisy'])} {verb} noisy, so no latency verdict; "
            f"rerun both with --threads 1 on a quieter machine, or a longer --min-time")


def _ffn_share(f: dict) -> str:
    reasons = []
    if f["d_ff_ratio"] is not None:
        reasons.append(f"d_ff = {f['d_ff_ratio']:g} x d_model, not 4: the matrices predict 2r/(4+2r) = {f['predicted']:.1%}")
    elif f.get("no_attention_matrix"):
        reasons.append("no weight matrix of attention's found (its projections unrecognised): the matrices predict "
                       f"{f['predicted']:.1%}")
    elif f["matrix_ratio"] is not None:
        reasons.append(f"FFN matrices are {f['matrix_ratio']:.2f}x the attention's, not 2x: they predict {f['predicted']:.1%}")
    extra = f["share"] - f["predicted"]
    if f.get("cond", 0) >= SHARE_SHOWN:  # conditioning's parameters dilute every share
        reasons.append(f"conditioning (projections that read no input: adaLN's) holds {f['cond']:.1%}")
        extra = f["share"] / (1 - f["cond"]) - f["predicted"]
    if abs(extra) >= SHARE_SHOWN:
        reasons.append(f"biases and norms move it {extra * 100:+.1f} points")
    why = "; ".join(reasons) if reasons else "as the rule says (biases and norms move it by less than 0.05 points)"
    return f"FFN holds {f['share']:.1%} of the parameters, against the 2/3 rule's 66.7%: {why}"


def _gradient(f: dict) -> str:
    word = "grows" if f["ratio"] >= 1 else "shrinks"
    return (f"the gradient norm at the layer input {word} by x{f['ratio']:.3g} from the last layer ({f['last']:.3g}) "
            f"to the first ({f['first']:.3g})")


def _cache_rule(f: dict) -> str:
    """How the expected cache size was counted: from d_model (the built-in block), or from the key and value widths
    the dataflow traced (grouped-query heads keep fewer keys than d_model)."""
    if f.get("from") == "trace":
        return "traced key + value widths per token x batch x positions x bytes"
    return "2 x layers x batch x positions x d_model x bytes"


MESSAGES = {
    # bench
    "bench.hf_need_weights": ("Hugging Face layer: need_weights is output_attentions; its sdpa attention returns no weights "
                              "(transformers warns and suggests eager), so 'on' runs the eager implementation: what asking the "
                              "model for attentions costs"),
    "bench.encoder_layer_path": ("the pre-hook that forces need_weights keeps nn.TransformerEncoderLayer off its fused "
                                 "encoder-layer path (it falls back to nn.MultiheadAttention's own path); without "
                                 "--need-weights it runs the fused path"),
    "bench.math_kernel": lambda f: (f"train: SDPA ran its math kernel (it materialises the attention matrix) at seq "
                                    f"{', '.join(map(str, f['seqs']))}: attention dropout {f['dropout']:g} is on, and the fused "
                                    f"CPU kernel takes no dropout; --dropout 0 shows the fused kernel"),
    "bench.need_weights": _need_weights,
    "bench.decode": lambda f: (f"decode {f['tokens']} tokens after a {f['prompt']}-token prompt: with the cache "
                               f"{f['cached_ms']:.3f} ms/token, recomputing the prefix {f['recomputed_ms']:.3f} ms/token; "
                               f"{_latency(f['latency'])}"),
    "bench.decode_growth": ("per-token time from the first to the last quarter of positions: cached x{cached:.2f}, "
                            "recomputed x{recomputed:.2f} (recomputing grows with the prefix, the cache should not much)"),
    "bench.cache_bytes": lambda f: (f"cache holds {fmt_bytes(f['bytes'])} ({f['bytes']:,} bytes) after the last token; "
                                    f"{_cache_rule(f)} = {f['analytic']:,}"),
    "bench.cache_bytes_differ": lambda f: (f"cache holds {fmt_bytes(f['bytes'])} ({f['bytes']:,} bytes) after the last token; "
                                           f"{_cache_rule(f)} = {f['analytic']:,} : they differ "
                                           f"(a cache of another width, or extra state)"),
    "bench.noisy": lambda f: (f"{f['count']} measurement(s) are noisy (IQR > {f['iqr_limit']:.0%} of the median, or a median "
                              f"> {f['tail_limit']}x the fastest sample: other work competed for the cores); try --threads 1 "
                              f"(ran with {f['threads']}), a quieter machine, or a longer --min-time"),
    "bench.regression": _regression,
    "bench.inconclusive": _inconclusive,
    "bench.train_input_only": ("train: the block has no trainable parameters; the backward computes the gradient with "
                               "respect to its input only"),
    "bench.train_skipped": ("train: skipped: the block has no trainable parameters and its output has no gradient path to "
                            "the input (detached? no_grad?): there is no backward to time"),
    # depth
    "depth.activations": ("activation RMS goes from {input_rms:.2f} (input) to {first:.2f} after layer 0 and {last:.2f} after "
                          "layer {last_index}: x{growth:.2f} over {layers} layers (x{per_layer:.3f} per layer)"),
    "depth.final_norm": "the final LayerNorm brings the output RMS from {before:.2f} back to {after:.2f}",
    "depth.no_final_norm": ("the last layer is Pre-LN and no final LayerNorm follows: the stack outputs activations of RMS "
                            "{rms:.2f}, un-normalised (a Pre-LN stack needs a final LayerNorm)"),
    "depth.gradient": _gradient,
    "depth.param_gradients": "parameter gradient norms range from {min:.3g} to {max:.3g} (first/last = {ratio:.3g})",
    "depth.residual_gains": "residual gain tr(J)/n per layer: {min:.3f} to {max:.3f}",
    "depth.mixed_placement": lambda f: (f"mixed norm placement ({' and '.join(f['placements'])}-LN in one stack): it changes "
                                        f"at layer(s) {', '.join(map(str, f['changes']))}; keep one placement (Pre-LN for deep "
                                        f"stacks)"),
    # params
    "params.ffn_share": _ffn_share,
    "params.no_ffn": "no FFN found (a projection consuming another projection's output, outside attention): FFN share omitted",
    "params.no_attention": "no attention found in the dataflow: FFN share omitted",
    "params.linear_chain": "`{first}` and `{second}` compose to one linear map: no nonlinearity between the FFN's projections",
}

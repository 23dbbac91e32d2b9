"""The sentences of the norms check (each norm alone: its invariances, its error at large magnitude, its gain at
init and where its gain acts), by kind, from their facts."""

from __future__ import annotations

MESSAGES = {
    "norms.none": "no norm found (a module invariant to scaling each token)",
    "norms.not_invariant": lambda f: "; ".join(
        f"{m['name']} ({m['cls']}) is named a norm but does not normalise: its input scaled {f['scales'][1] / f['scales'][0]:g}x "
        f"moves its output {m['ratio']:.3g}x (a LayerNorm or RMSNorm leaves it; the square root forgotten gives "
        f"1/{f['scales'][1] / f['scales'][0]:g})" for m in f["modules"]),
    "norms.across_tokens": lambda f: "; ".join(
        f"{m['name']} ({m['cls']}) is named a norm but mixes tokens: changing the other tokens moves one token's output "
        f"by {m['tokens']:.3g} (relative; a LayerNorm or RMSNorm normalises each token alone: statistics taken over the "
        f"sequence axis?)" for m in f["modules"]),
    "norms.ok": lambda f: (f"{len(f['norms'])} norm(s) alone agree with float64 at input RMS {f['scale']:g} in "
                           f"{f['dtype']}; none doubles its input at init"),
    "norms.large": lambda f: "; ".join(
        f"{n['name']} alone at input RMS {f['scale']:g} ({f['dtype']}) differs from float64 by {n['error']:.2e} "
        f"(> {f['limit']:g}; output RMS {n['got_rms']:.3g}, expected {n['expected_rms']:.3g}): it squares before it "
        f"upcasts? (fp16 overflows above |x| ~ 256)" for n in f["large"]),
    "norms.shifted": lambda f: "; ".join(
        f"{n['name']} subtracts the mean, yet alone on tokens of spread 1 shifted by {f['shift']:g} ({f['dtype']}) "
        f"moves by {n['error']:.2e} of its output (> {f['limit']:g}): its statistics cancel (a one-pass variance, E[x^2] - E[x]^2, loses the "
        f"spread under a large mean; a stream's massive activations reach it)" for n in f["shifted"]),
    "norms.offset_init": lambda f: "; ".join(
        f"{o['name']} is a (1 + w) norm whose output RMS at init is {o['gain']:.2f} (> {f['limit']:g}): its w is "
        f"initialised to 1, as a plain norm's weight would be, so it doubles its input" for o in f["offset"]),
    "norms.not_unit": lambda f: "; ".join(f"{n['name']} (width {n['width']}) at unit gain returns tokens of RMS {n['rms']:.6f}, not 1: a "
                                          f"LayerNorm or RMSNorm divides by the variance over n (x.var() divides by n - 1)" for n in f["off_unit"]),
    "norms.random_gain": lambda f: "; ".join(
        f"{r['name']}'s gain at init is negative in {r['negative']:.0%} of its channels (RMS {r['gain']:.3g}): drawn at "
        f"random, not a constant (an init loop over every parameter, `normal_(p, 0, 0.02)`, reached the norms; a norm's "
        f"weight starts at ones)" for r in f["random_gain"]),
    "norms.gain_inside": lambda f: "; ".join(
        f"{n['name']} with its per-channel parameters redrawn is no longer a per-channel scale and shift of its output "
        f"as built (residual {n['residual']:.2g}, limit {f['limit']:g}): its gain reaches the statistics, applied "
        f"before it normalises (x * w divided by the RMS of x * w), where a LayerNorm or RMSNorm scales the "
        f"normalised token; at unit gain the two agree" for n in f["not_affine"]),
    "norms.gain_not_linear": lambda f: "; ".join(
        f"{n['name']}'s output is not linear in its per-channel parameters: with them at the midpoint of two draws it "
        f"is off the midpoint of the two outputs by {n['residual']:.2g} of their difference (limit {f['limit']:g}): "
        f"its gain is applied twice (x * w * w) or through a function, where a LayerNorm or RMSNorm multiplies by it "
        f"once; at unit gain the two agree" for n in f["not_linear"]),
    "norms.half_eps": lambda f: "; ".join(
        f"{n['name']} run in float16 returns {n['got']} for a constant token (every channel "
        f"{' or '.join(f'{c:g}' for c in f['constants'])}; a zeroed padding embedding is one too): its variance there is "
        f"0 and it adds its eps in float16, where an eps below 6e-8 (1e-12, BERT's) is 0; keep eps >= 1e-6, or compute "
        f"the statistics in float32"
        for n in f["half_nan"]),
}

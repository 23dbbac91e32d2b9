"""A block's anatomy read from one traced forward: which modules feed attention, which form the FFN, which normalise.

Mechanism: a `TorchFunctionMode` sees every torch function the forward calls, at the level the user
wrote it (`F.linear`, `torch.addmm`, `F.scaled_dot_product_attention`, `F.multi_head_attention_forward`,
`softmax`, `@`), whatever the modules are called and however they nest. Each tensor carries a
provenance: the projections (modules owning a weight matrix) whose outputs reach it with no other
projection in between, and whether a nonlinearity acted since. Attention is recognised by what it
does: an SDPA or MHA call, or a softmax over a product of two activations whose product is then
multiplied by a third. Norms are recognised by what they do too: a module with only per-feature
parameters whose output is invariant to scaling each token. `torch.fx` and `torch.export` were set
aside: both need the forward to be traceable as a graph, and user blocks branch on shapes, call
Python helpers and read `self.training`; the mode needs nothing of the code but that it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from tblock_cli.anatomy.attention import AttentionCall
from tblock_cli.anatomy.norms import find_norms
from tblock_cli.anatomy.provenance import NORM, STREAM, Attn, Marker, owns_several_matrices, qualified
from tblock_cli.anatomy.roles import COND, GROUPS, ModuleUse, assign_roles, mha_rows
from tblock_cli.anatomy.tracer import Tracer
from tblock_cli.probes import tensors, train_mode

# Parameters outside attention, FFN and norms above this share of the block: in a standard block only biases could land
# there, and they are attributed to their layers. The FFN-share check warns of them; residual's large-input probe
# leaves such a block unjudged (a gate or mixer of its own may bend the stream by design).
OTHER_SHARE_MAX = 0.01


def _bottleneck(tr: Tracer, first: str, second: str, d_model: int) -> bool:
    """Whether two projections with no nonlinearity between narrow through fewer channels than the stream and the
    second's output have: a low-rank factorisation (a LoRA adapter's A and B beside a frozen projection, a factorised
    weight), one linear map by design, not an FFN that lost its activation (which widens)."""
    a, b = tr.counts.out_shape.get(first), tr.counts.out_shape.get(second)
    return bool(a and b) and a[-1] < d_model and a[-1] < b[-1]


@dataclass(frozen=True)
class Dataflow:
    modules: tuple[ModuleUse, ...]
    attention: tuple[AttentionCall, ...]
    linear_chains: tuple[tuple[str, str], ...]  # FFN (first, second) projections with no nonlinearity between
    tokens: int  # batch x seq of the probe
    total: int  # parameters, shared tensors once
    stream_norms: bool = False  # some norm normalises the residual stream (width d_model)
    unnormed_attention: tuple[str, ...] = ()  # query projections that read no normalised stream
    unnormed_ffn: tuple[str, ...] = ()  # FFN input projections that read no normalised stream
    split_kv: tuple[str, ...] = ()  # key/value projections that read the raw stream while their queries read a normalised one
    output_normed: bool = False  # the block's output comes straight from a norm (Post-LN)
    # every sublayer reads the raw stream and its output is normalised before the residual add (OLMo-2's placement)
    sublayer_post: bool = False
    norms: dict = field(default_factory=dict)  # module name -> width of every norm module found (find_norms)
    act_after_product: tuple[tuple[str, ...], ...] = ()  # projections multiplied together before an activation acts
    slips: int = 0  # torch calls the tracer could not record (the forward went on): what it saw may be incomplete
    slip_errors: tuple[str, ...] = ()  # the first few of their errors
    narrowed: tuple[tuple[str, str, str, str], ...] = ()  # live activations cast to half precision (Tracer.narrowed)
    calls: dict = field(default_factory=dict)  # module name -> how many times the probe's forward called it
    ffn_middles: tuple[str, ...] = ()  # FFN projections inside a longer chain (experts between a pre and a post projection)

    @property
    def conditioning(self) -> int:
        """Parameters of projections that read only constants of the block (COND: adaLN's modulation), in "other"."""
        return sum(m.params for m in self.modules if m.role == COND)

    @property
    def stray(self) -> int:
        """Parameters outside attention, FFN and norms that condition nothing."""
        return self.group_params()["other"] - self.conditioning

    def group_params(self, matrices_only: bool = False) -> dict[str, int]:
        out = dict.fromkeys(GROUPS, 0)
        for m in self.modules:
            out[m.group] += m.matrix_params if matrices_only else m.params
        return out

    @property
    def found(self) -> dict[str, bool]:
        return {"attention": bool(self.attention), "ffn": any(m.group == "ffn" for m in self.modules)}


def predicted_ffn_share(mats: dict[str, int]) -> float:
    """The FFN share the weight matrices alone predict: ffn / (ffn + attention); 2r / (4 + 2r) for d_ff = r d."""
    return mats["ffn"] / (mats["ffn"] + mats["attention"]) if mats["attention"] else 1.0



def trace(module: nn.Module, call, x: torch.Tensor, d_model: int) -> Dataflow:
    """One eval-mode, grad-enabled forward of call(x) under the tracer (grad keeps MHA off its fused fast path)."""
    norms = find_norms(module, d_model, x.device, x.dtype)
    tr = Tracer(module, d_model)
    tr.attn.tokens = x.shape[-2] if x.ndim >= 2 else None
    tr.prov.watch(x)
    tr.prov.put(x, {STREAM: 0})
    hooks, reads, calls = [], {}, {}

    def enter(name: str, args: tuple) -> None:  # the module running now, and where its first call's input comes from
        tr.module_stack.append(name)
        calls[name] = calls.get(name, 0) + 1
        if args and isinstance(args[0], torch.Tensor):
            reads.setdefault(name, tr.prov.get(args[0]))

    def stream_norm(args: tuple, out) -> None:  # a norm of the residual stream; per-head norms keep q as q
        first = next(tensors(out), None)  # a fused add returns (normed, sum)
        if first is not None and first.ndim and first.shape[-1] == d_model:  # a norm with no parameters says no width:
            tr.prov.stream_norms = True  # nanochat's q_norm and k_norm are per head, found at d_model
            tr.prov.norm_out(args, out)

    for name, m in module.named_modules():
        if norms.get(name) == d_model:
            hooks.append(m.register_forward_hook(lambda _m, a, o: stream_norm(a, o)))
        hooks.append(m.register_forward_pre_hook(lambda _m, a, _n=name: enter(_n, a)))
        hooks.append(m.register_forward_hook(lambda _m, _a, o, _n=name: tr.leave(_n, o)))
    try:
        with train_mode(module, False), torch.enable_grad(), tr:
            out = call(x)
    finally:
        for h in hooks:
            h.remove()
    # the width each norm was called at (a norm with no parameters was found at d_model, whatever it normalises)
    norms = {n: (tr.counts.out_shape.get(n) or (w,))[-1] for n, w in norms.items()}
    role, chains = assign_roles(tr)
    # a chain whose first projection's output also reaches the block's output on its own is a sublayer's output that
    # an adapter reads too (Houlsby's, after the FFN's down projection), not an FFN that lost its activation
    chains = [(a, b) for a, b in chains if not _bottleneck(tr, a, b, d_model) and a not in tr.prov.get(out)]
    modules = []
    seen: set[int] = set()
    for name, m in module.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            modules.extend(mha_rows(name, m, tr, role, seen))
            continue
        if owns_several_matrices(m):  # bare matrices: a row each, named by the parameter
            for pn, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                key = qualified(name, pn)
                if key in tr.prov.slices:
                    modules.extend(slice_rows(key, p, [], tr, role))
                    continue
                r = role.get(key) or ("attn.inner" if attention_owner(name, m, role) else "other")
                modules.append(ModuleUse(key, r, p.numel(), p.numel() if p.ndim >= 2 else 0,
                                         tr.counts.out_shape.get(key), tr.counts.flops.get(key, 0)))
            continue
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for p in own)
        if name in tr.prov.slices:  # one weight matrix whose row ranges are projections of their own
            matrix = next(p for p in own if p.ndim >= 2)
            modules.extend(slice_rows(name or "(root)", matrix, [p for p in own if p is not matrix], tr, role, key=name))
            continue
        in_norm = any(name == n or name.startswith(n + ".") for n in norms)
        r = "norm" if in_norm else "attn.out" if name in tr.attn.mha_out else role.get(name) or inner_role(name, m, reads, role)
        modules.append(ModuleUse(name or "(root)", r, sum(p.numel() for p in own), sum(p.numel() for p in own if p.ndim >= 2),
                                 tr.counts.out_shape.get(name), tr.counts.flops.get(name, 0)))
    total = sum(p.numel() for p in module.parameters())
    assert sum(m.params for m in modules) == total, (sum(m.params for m in modules), total)
    tokens = x.shape[0] * x.shape[1] if x.ndim >= 2 else 1
    def normed(n: str, depth: int = 0) -> bool:  # a low-rank chain reads what its first projection reads
        src = tr.prov.linear_in.get(n, {})
        return NORM in src or (depth < 3 and any(normed(s, depth + 1) for s in src if s in tr.prov.linear_in and s != n))
    # placement is judged on projections that read the stream: one reading only constants (cross-attention's keys and
    # values over a learned context, adaLN's modulation of a timestep embedding) has no norm to miss
    stream = lambda n: n in tr.prov.linear_in and not tr.prov.reads_constant(n)  # noqa: E731
    queries = sorted({q for c in tr.attn.calls for q in c.q if stream(q)})
    ffn_ins = sorted(n for n, r in role.items() if r in ("ffn.in", "ffn.gate") and not tr.prov.reads_constant(n))
    split_kv = sorted({n for c in tr.attn.calls if c.q and all(normed(q) for q in c.q if q in tr.prov.linear_in)
                       for n in c.k + c.v if stream(n) and not normed(n)})
    mods = dict(module.named_modules())
    # a chain reading no tensor of the stream's width is not the block's FFN (x-transformers' dynamic position bias: an
    # MLP over distances, width 1 in)
    stream_width = lambda n: getattr(mods.get(n), "in_features", d_model) == d_model  # noqa: E731
    # An FFN reading a sublayer's output and not the stream (a Houlsby adapter on attention's output) needs no norm.
    # Any may read the stream where the input was not followed to the output or to any projection (copied outside
    # torch's calls), and so may one whose input has no provenance at all (the stream written into a view of a buffer)
    followed = STREAM in tr.prov.get(out) or any(STREAM in src for src in tr.prov.linear_in.values())
    on_stream = lambda n: not followed or STREAM in tr.prov.linear_in.get(n, {}) or not tr.prov.linear_in.get(n)  # noqa: E731
    placement = (tr.prov.stream_norms, tuple(q for q in queries if not normed(q)),
                 tuple(n for n in ffn_ins if not normed(n) and stream_width(n) and on_stream(n)),
                 tuple(split_kv + tr.prov.split_streams), tr.prov.get(out) == {NORM: 0})
    placement += (sublayer_post(tr, role, queries, ffn_ins, normed),)
    return Dataflow(tuple(modules), tuple(tr.attn.calls), tuple(chains), tokens, total, *placement, norms=norms,
                    act_after_product=tuple(sorted(set(tr.prov.act_after_product))), slips=tr.slips,
                    slip_errors=tuple(tr.slip_errors), narrowed=tuple(tr.narrowed), calls=calls,
                    ffn_middles=tuple(sorted(tr.prov.ffn_middles)))


def slice_rows(shown: str, matrix: torch.Tensor, others: list, tr: Tracer, role: dict, key: str | None = None) -> list[ModuleUse]:
    """A row per row range of one weight matrix used as a projection of its own (W[:3 * d] for q, k and v, W[3 * d:]
    for the output), its parameters by rows; rows no range covers, and the module's other parameters, one row more
    with the role the rest of the matrix took where it took one, other otherwise."""
    key = shown if key is None else key
    numel, cols = matrix.numel(), matrix.shape[1]
    rows, covered = [], 0
    ranges = sorted(tr.prov.slices[key])
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):  # overlapping ranges: the matrix is not split in rows
        ranges = []
    for r0, r1 in ranges:
        sub = f"{key}[{r0}:{r1}]"
        rows.append(ModuleUse(f"{shown}[{r0}:{r1}]", role.get(sub, "other"), (r1 - r0) * cols, (r1 - r0) * cols,
                              tr.counts.out_shape.get(sub), tr.counts.flops.get(sub, 0)))
        covered += (r1 - r0) * cols
    rest = numel - covered + sum(p.numel() for p in others)
    if rest:
        roles = {u.role for u in rows}
        r = roles.pop() if len(roles) == 1 else "other"
        rows.append(ModuleUse(shown if not rows else f"{shown} (rest)", r, rest, numel - covered, None, 0))
    return rows


def inner_role(name: str, m: nn.Module, reads: dict, role: dict) -> str:
    """attn.inner for a module with parameters that is no projection and reads only q, k or v projections' outputs
    (Primer's depthwise convolutions after each of them, a per-head scale), or that is an attention module itself
    (`attention_owner`): part of attention; other otherwise."""
    sources = {s for s in reads.get(name, {}) if not isinstance(s, Marker)}
    inside = sources and all(role.get(s, "").startswith("attn.") and role[s] not in ("attn.out", "attn.gate") for s in sources)
    return "attn.inner" if inside or attention_owner(name, m, role) else "other"


def attention_owner(name: str, m: nn.Module, role: dict) -> bool:
    """Whether m is an attention module: not the root, some of its own projections (children or bare matrices) have
    attention roles and none an FFN role. Parameters it holds beside them belong to attention (x-transformers' memory
    keys and values, concatenated to k and v; per-head scales and sinks)."""
    if not name:
        return False
    own = [qualified(name, c) for c in m._modules] + [qualified(name, p) for p, _ in m.named_parameters(recurse=False)]
    roles = [role[n] for n in own if n in role]
    return any(r.startswith("attn.") for r in roles) and not any(r.startswith("ffn.") for r in roles)


def sublayer_post(tr, role: dict, queries: list, ffn_ins: list, normed) -> bool:
    """Whether every sublayer reads the un-normalised stream and hands its output to a full-width norm before the
    residual add: each attention call's output (or the projection reading it) and each FFN output projection."""
    ffn_outs = [n for n, r in role.items() if r == "ffn.out"]
    if not tr.prov.stream_norms or not tr.attn.calls or any(normed(n) for n in queries + ffn_ins):
        return False
    for i in range(len(tr.attn.calls)):
        marker = Attn(i)
        outs = [n for n, src in tr.prov.linear_in.items() if marker in src]
        if marker not in tr.prov.normed_outputs and not any(n in tr.prov.normed_outputs for n in outs):
            return False
    return all(n in tr.prov.normed_outputs for n in ffn_outs)


"""One comparison, A against B: build both, carry A's weights to B, compare what both compute, localise a difference."""

from __future__ import annotations

import dataclasses

import torch

from tblock_cli.comparing.glu import split_glu
from tblock_cli.comparing.localise import capture, component_diffs, explain, head_dim_of
from tblock_cli.comparing.mapping import Slot, build_mapping, execution_order, read_map, slots_of
from tblock_cli.comparing.report import CompareReport, Comparison, Finding
from tblock_cli.comparing.sides import BUILTIN, build_sides, is_builtin, spec_of
from tblock_cli.errors import ConfigError, reraise_as_measure_error
from tblock_cli.probes import TOLERANCE, f64, parameters_replaced, rel_diff, same_draws, train_mode, zero_dropout
from tblock_cli.report import Status
from tblock_cli.runtime import dtype_name, session
from tblock_cli.subject.kvcache import decode_chunks, has_decode


@dataclasses.dataclass(frozen=True)
class Judge:
    """Equal within the dtype's relative tolerance, or within --atol/--rtol (torch.allclose's rule) when given."""

    tol: float
    atol: float | None = None
    rtol: float | None = None

    def __call__(self, name: str, b: torch.Tensor, a: torch.Tensor, worst: str | None = None) -> Comparison:
        a64, b64 = f64(a), f64(b)
        rel = rel_diff(b64, a64)
        max_abs = (b64 - a64).abs().max().item() if a64.numel() and rel != float("inf") else (0.0 if not a64.numel() else rel)
        if self.atol is None and self.rtol is None:
            return Comparison(name, rel, max_abs, self.tol, rel <= self.tol, worst)
        atol, rtol = self.atol or 0.0, self.rtol or 0.0
        equal = bool(torch.isfinite(b64).all()) and bool(((b64 - a64).abs() <= atol + rtol * a64.abs()).all())
        return Comparison(name, rel, max_abs, atol, equal, worst)

    @property
    def component_tol(self) -> float:
        return self.tol if self.atol is None and self.rtol is None else max(self.atol or 0.0, self.rtol or 0.0)


def run_compare(a, b, setup, *, options: dict, kwargs_a=None, kwargs_b=None, dtype_b: str | None = None,
                compile: bool = False, backend: str | None = None, atol: float | None = None,
                rtol: float | None = None, map_file: str | None = None) -> CompareReport:
    """A against B (or A against torch.compile(A)); options are the shared size flags, judged by options.compare."""
    options = {"dropout": 0.0, **{k: v for k, v in options.items() if v is not None}}  # gradients need no dropout
    if compile:
        return compile_report(a, setup, options, kwargs_a, backend)
    overrides = read_map(map_file)
    with session(options.get("threads")):  # the sides are built under the run's threads, each after its memory gate
        sa, subject_a, sb, subject_b, followed = build_sides(a, b, setup, options, kwargs_a, kwargs_b, dtype_b, estimate)
    cfg = sa.cfg
    if (cfg.d_model, cfg.batch, cfg.seq) != (sb.cfg.d_model, sb.cfg.batch, sb.cfg.seq):
        differ = [f"{k}: A {ka}, B {kb}" for k, ka, kb in (("d_model", cfg.d_model, sb.cfg.d_model), ("batch", cfg.batch, sb.cfg.batch),
                                                           ("seq", cfg.seq, sb.cfg.seq)) if ka != kb]
        raise ConfigError(f"the two sides take different inputs ({'; '.join(differ)}); give both the same width "
                          f"(--d-model, or --kwargs-a/--kwargs-b for the side that differs)")
    judge = Judge(max(TOLERANCE[sa.dtype], TOLERANCE[sb.dtype]), atol, rtol)
    from tblock_cli.anatomy import trace

    with session(cfg.threads):
        gen = torch.Generator().manual_seed(cfg.seed)
        x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen)
        v = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen)
        xa, xb = x.to(sa.device, sa.dtype), x.to(sb.device, sb.dtype)
        try:
            flows = trace(subject_a.module, subject_a, xa, cfg.d_model), trace(subject_b.module, subject_b, xb, cfg.d_model)
            slots_a, slots_b = (split_glu(s.module, s, x, slots_of(s.module, flow, execution_order(s.module, s, x)))
                                for s, x, flow in ((subject_a, xa, flows[0]), (subject_b, xb, flows[1])))
        except Exception as e:  # noqa: BLE001
            reraise_as_measure_error(e, "compare: tracing a side failed")
        mapping = build_mapping(subject_a.module, subject_b.module, slots_a, slots_b, overrides)
        mapping.carry(subject_a.module, subject_b.module)
        try:
            comparisons = compare_all(subject_a, subject_b, xa, xb, v, mapping, judge, train=cfg.dropout == 0)
            cap_a = capture(subject_a.module, subject_a, xa, slots_a)
            cap_b = capture(subject_b.module, subject_b, xb, relabelled(slots_b, slots_a, mapping))
            inert = inert_biases(mapping.zeroed, {"a": (subject_a, xa), "b": (subject_b, xb)}, judge.component_tol, gen)
        except Exception as e:  # noqa: BLE001
            reraise_as_measure_error(e, "compare: running a side failed")
        names = (a if isinstance(a, str) else BUILTIN if a is None else type(a).__name__,
                 b if isinstance(b, str) else BUILTIN if b is None else type(b).__name__)
        run = sa.run_info(None, a=names[0], b=names[1], kwargs_a=sa.kwargs, kwargs_b=sb.kwargs, dtype_b=dtype_name(sb.dtype),
                     atol=atol, rtol=rtol, map=map_file, followed=followed)
    diffs = component_diffs(cap_a, cap_b)
    findings = mapping_findings(mapping, followed, is_builtin(a), is_builtin(b), inert)
    differ = [c for c in comparisons if not c.equal]
    if differ:
        first = explain(diffs, cap_a, cap_b, head_dim_of(flows[0]) or head_dim_of(flows[1]), judge.component_tol)
        with session(cfg.threads):
            first = beyond_one_forward(first, differ, subject_a, subject_b, xa, xb, mapping, slots_a,
                                       relabelled(slots_b, slots_a, mapping), judge)
        findings.append(Finding(Status.FAIL, "compare.differ", {"what": [c.name for c in differ]}))
        findings.append(Finding(Status.FAIL, "compare.first_difference", first) if first else
                        Finding(Status.INFO, "compare.not_localised", {"captured": len(diffs)}))
    else:
        findings.append(Finding(Status.PASS, "compare.equal", {"what": [c.name for c in comparisons], "tol": judge.component_tol}))
    run = dataclasses.replace(run, subject=f"{names[0]} vs {names[1]}", warnings=tuple(dict.fromkeys(sa.warnings + sb.warnings)))
    return CompareReport(names[0], names[1], tuple(comparisons), tuple(findings), mapping_dict(mapping),
                         tuple(diffs) if differ or dtype_b else (), None, run)


def estimate(cfg, params: int | None) -> int:
    """One side's memory need: its weights and gradients, and one forward's saved activations."""
    from tblock_cli.runtime import estimate_bytes

    return estimate_bytes(cfg, params=params)


def relabelled(slots_b: list[Slot], slots_a: list[Slot], mapping) -> list[Slot]:
    """B's slots under the roles of the A slots they were paired with, so a capture of B's `up_proj` is compared
    with A's `up_proj` even where the two blocks use it differently (that difference is the finding)."""
    by_param_a: dict[str, list[Slot]] = {}
    for s in slots_a:
        by_param_a.setdefault(s.param, []).append(s)
    role_of: dict[tuple, str] = {}
    for sa, sb, _how in mapping.pairs:
        if sb.rows is None and sa.rows is None:  # a whole parameter: its slots pair up in order
            own_b = [s for s in slots_b if s.param == sb.param]
            own_a = by_param_a.get(sa.param, [])
            if len(own_a) == len(own_b):
                role_of.update({(s.param, s.rows): t.role for s, t in zip(own_b, own_a)})
        else:
            role_of[(sb.param, sb.rows)] = sa.role
    return [dataclasses.replace(s, role=role_of.get((s.param, s.rows), s.role)) for s in slots_b]


def compare_all(sa, sb, xa, xb, v, mapping, judge: Judge, train: bool = True) -> list[Comparison]:
    """Outputs (eval), outputs under a padding mask, input and parameter gradients (train; eval when dropout is on,
    whose random masks differ between the sides), cached decoding."""
    out = []
    with train_mode(sa.module, False), train_mode(sb.module, False), torch.no_grad():
        ya, yb = sa(xa.clone()), sb(xb.clone())
        out.append(judge("outputs", yb, ya))
        if sa.pad_keyword and sb.pad_keyword:
            pad = torch.zeros(xa.shape[0], xa.shape[1], dtype=torch.bool)
            pad[0, -max(1, xa.shape[1] // 4):] = True  # the last quarter of sample 0 is padding
            ya, yb = sa(xa.clone(), pad.to(xa.device)), sb(xb.clone(), pad.to(xb.device))
            out.append(judge("padded", yb[~pad.to(yb.device)], ya[~pad.to(ya.device)]))
    grads = []
    for s, x in ((sa, xa), (sb, xb)):
        x = x.detach().clone().requires_grad_(True)
        for p in s.module.parameters():
            p.grad = None
        # A block's own dropout (built in, not from --dropout) would draw other masks on each side: zeroed where it
        # can be reached, and the same random stream for both where it cannot (a functional dropout of a literal p).
        with train_mode(s.module, train), zero_dropout(s.module), same_draws(x.device), torch.enable_grad():
            (s(x) * v.to(x.device, x.dtype)).float().sum().backward()
        grads.append(x.grad)
    out.append(judge("input_grad", grads[1], grads[0]))
    ga = {n: p.grad for n, p in sa.module.named_parameters() if p.grad is not None}
    gb = {n: p.grad for n, p in sb.module.named_parameters() if p.grad is not None}
    worst = None
    for pa, pb, _ in mapping.pairs:
        if pa.param in ga and pb.param in gb:
            c = judge("param_grads", pb.get(gb), pa.get(ga), pa.label)
            worst = c if worst is None or c.rel > worst.rel or (worst.equal and not c.equal) else worst
    if worst is not None:
        out.append(worst)
    for p in list(sa.module.parameters()) + list(sb.module.parameters()):
        p.grad = None
    if has_decode(sa.module) and has_decode(sb.module) and xa.shape[1] >= 2:
        sizes = [xa.shape[1] // 2] + [1] * (xa.shape[1] - xa.shape[1] // 2)  # a prompt, then one token at a time
        try:
            with train_mode(sa.module, False), train_mode(sb.module, False), torch.no_grad():
                da, _ = decode_chunks(sa.module, xa.clone(), sizes)
                db, _ = decode_chunks(sb.module, xb.clone(), sizes)
            out.append(judge("decode", db, da))
        except (ValueError, NotImplementedError):
            pass  # a side that cannot decode (bidirectional): nothing to compare
    return out


def beyond_one_forward(first, differ, sa, sb, xa, xb, mapping, slots_a, slots_b, judge) -> dict | None:
    """What one forward's captures cannot name: a fused q/k/v split in another order (tried where the outputs
    differ), and a difference on the cached path only (the decode step and the component in it)."""
    from tblock_cli.comparing.decoding import localise_decode
    from tblock_cli.comparing.reorder import fused_order

    names = {c.name for c in differ}
    try:
        if "outputs" in names:
            order = fused_order(sa, sb, xa, xb, mapping, judge)
            return {**(first or {}), "fused_order": order} if order else first
        if names == {"decode"}:
            return localise_decode(sa, sb, xa, xb, slots_a, slots_b, judge) or first
    except Exception:  # noqa: BLE001 - a side that cannot be rerun so: the difference stays as localised
        return first
    return first


def inert_biases(zeroed, sides: dict, tol: float, gen: torch.Generator) -> set[tuple[str, str]]:
    """Of the one-sided biases set to zero, those whose values change nothing: given random values on their side, the
    eval output stays within tol (a key bias, which softmax ignores: every score of a row moves by the same amount)."""
    inert, base = set(), {}
    for side, name in zeroed:
        subject, x = sides[side]
        params = dict(subject.module.named_parameters())
        if name not in params:
            continue
        with torch.no_grad(), train_mode(subject.module, False):
            if side not in base:
                base[side] = subject(x)
            with parameters_replaced(params, [name], lambda _n, p: torch.randn(p.shape, generator=gen).to(p)):
                moved = subject(x)
        if rel_diff(moved, base[side]) <= tol:
            inert.add((side, name))
    return inert


def mapping_findings(mapping, followed: dict, a_builtin: bool, b_builtin: bool, inert: set = frozenset()) -> list[Finding]:
    out = [Finding(Status.INFO, "mapping.carried", mapping.counts())]
    out += [Finding(Status.WARN, "mapping.name_role", {"a": an, "a_role": ar, "b": bn, "b_role": br})
            for an, ar, bn, br in mapping.disagreements]
    out += [Finding(Status.INFO, "mapping.bias_zeroed", {"side": side.upper(), "param": p, "inert": (side, p) in inert})
            for side, p in mapping.zeroed]
    out += [Finding(Status.INFO, "mapping.at_init", {"side": side.upper(), "param": p, "value": v})
            for side, p, v in mapping.at_init]
    if followed:
        out.append(Finding(Status.INFO, "compare.builtin_follows", {"side": "A" if a_builtin else "B", **followed}))
    return out


def mapping_dict(mapping) -> dict:
    return {"counts": mapping.counts(), "pairs": [{"a": sa.label, "b": sb.label, "role": sa.role, "by": how}
                                                  for sa, sb, how in mapping.pairs]}


def compile_report(a, setup, options: dict, kwargs_a, backend: str | None = None) -> CompareReport:
    from tblock_cli.comparing.compile import compiler, run_compile

    spec = spec_of(a)
    s = setup(spec, {**options, **({"kwargs": kwargs_a} if kwargs_a is not None else {})})
    if backend == "inductor" and s.device.type == "cpu" and compiler() is None:
        raise ConfigError("--backend inductor builds C++ kernels for the CPU and no C++ compiler (g++, clang++, cc) "
                          "was found: install one, or use --backend aot_eager")
    with session(s.cfg.threads):
        subject = s.build(estimate, "compare")
        gen = torch.Generator().manual_seed(s.cfg.seed)
        x = torch.randn(s.cfg.batch, s.cfg.seq, s.cfg.d_model, generator=gen).to(s.device, s.dtype)
        v = torch.randn(x.shape, generator=gen).to(s.device, s.dtype)
        result = run_compile(subject, s.cfg, x, v, backend)
        name = a if isinstance(a, str) else BUILTIN if a is None else type(a).__name__
        run = dataclasses.replace(s.run_info(subject, compile=True, a=name), subject=f"{name} vs torch.compile({name})")
    tol = result["tolerance"]
    comps = tuple(Comparison(f"compiled {k}", result[k], None, tol, result[k] <= tol)
                  for k in ("outputs", "input_grad", "param_grads") if k in result)
    findings = []
    if result["cxx"] is None and backend is None and result["backend"] != "inductor":  # the default stepped down
        findings.append(Finding(Status.WARN, "compile.no_compiler", {"backend": result["backend"]}))
    if "error" in result:
        findings.append(Finding(Status.FAIL, "compile.failed", {"error": result["error"]}))
    else:
        findings.append(Finding(Status.INFO, "compile.graph_breaks", {"count": result["graph_breaks"], "graphs": result["graphs"],
                                                                       "reasons": result["reasons"]}))
        findings.append(Finding(Status.INFO, "compile.recompiles", {"recompiles": result["recompiles"],
                                                                     "train_graphs": result["train_graphs"]}))
        findings.append(Finding(Status.PASS if result["equal"] else Status.FAIL, "compile.equal" if result["equal"] else "compile.differ",
                                {k: result[k] for k in ("outputs", "input_grad", "param_grads", "backend", "tolerance")}))
    return CompareReport(name, f"torch.compile({name})", comps, tuple(findings), {}, (), result, run)

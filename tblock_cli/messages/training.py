"""The sentences of the training-time checks (derivative, checkpointing, meta_init, state_dict, precision,
optimizer_step, grad_accumulation, train_state) and of global_state, by kind, from their facts."""

from __future__ import annotations

from tblock_cli.messages.words import names


def _derivative(f: dict) -> str:
    others = f"; also {names(n for n, _ in f['tensors'][1:6])}" if len(f["tensors"]) > 1 else ""
    where = f"worst for {f['tensor']} ({f['tensor_error']:.1e}){others}" if f.get("tensor") else "no single tensor alone shows it"
    return (f"autograd's directional derivative differs from central finite differences by {f['error']:.1e} relative "
            f"(limit {f['limit']:g}) while the differences at three steps agree with each other: the gradient is not the "
            f"derivative; {where}"
            + ("; dropout active with the RNG reseeded, so a recompute with other masks shows here" if f["dropout"] else "")
           )


def _checkpointing_differs(f: dict) -> str:
    return (f"under {f['how']} the {f['where']} differs from the plain block's by {f['diff']:.1e} (limit {f['limit']:g})"
            + (" with dropout active and the same seed: a recompute that does not reproduce the forward" if f["dropout"] else "")
           )


def _checkpointing_same(f: dict) -> str:
    own = f"; the block's own switch too ({names(f['switches'])})" if f["switches"] else ""
    return (f"non-reentrant checkpointing leaves outputs and gradients as they were (max {max(p['diff'] for p in f['probes'].values()):.1e})"
            f"{own}; every parameter gets its gradient from an input without grad"
            + (f" (once torch's spectral norm does not run its power iteration again in the recompute: with it, "
               f"{f['power_iteration']}, torch's own)" if f.get("power_iteration") else ""))


def _meta(f: dict) -> str:
    kept = (f"; saved buffers its init leaves unset (a checkpoint load restores them): {names(f['persistent_unset'])}"
            if f.get("persistent_unset") else "")
    return f"init: {names(f['init']) or 'none of its own'}{kept}"


def _switched(f: dict, which: list) -> str:
    return "; ".join(f"{n} {f['changed'][n]['before']} -> {f['changed'][n]['after']} (during {f['changed'][n]['check']})"
                     for n in which)


def _state_plain(f: dict) -> str:
    return f"the forward reads tensors kept as plain attributes (not moved by .to(), not saved): {names(f['plain_tensors'])}"


def _precision(f: dict) -> str:
    where = f"; the first component whose error jumps: {f['component']} ({f['component_error']:.1e})" if f["component"] else ""
    how = "under torch.autocast(bfloat16)" if f["how"] == "autocast" else "after .to(bfloat16)"
    return (f"{how}, at {f['seq']} tokens, a component's relative error per position (75th percentile) against float32 "
            f"reaches {f['errors'][f['how']]:.1e}, above {f['limit']:g}{where}{_products(f)}")


def _products(f: dict) -> str:
    """Where this CPU has no bfloat16 matrix instructions, the products ran as float32 products rounded once."""
    if f.get("products") != "float32-accumulated":
        return ""
    return "; bfloat16 matmuls accumulated in float32, rounded once (this CPU has no bfloat16 GEMM)"


_HISTORY = {"shorter": "a sequence half as long", "longer": "a sequence twice as long", "padded": "a padded batch",
            "standard": "the standard input"}


def _through(f) -> str:
    others = [n for n in f["stuck"] if n not in f["zeros"]]
    return f"; held with them: {names(others)}" if others else ""


def _optimizer_ok(f: dict) -> str:
    zero = f"; zero gradient, not moved (can be legitimate): {names(f['zero_grad'])}" if f["zero_grad"] else ""
    if f.get("below_resolution"):
        zero += (f"; a gradient of rounding size, too small for one step to move (a pre-softmax bias's, by the "
                 f"softmax's shift invariance): {names(f['below_resolution'])}")
    frozen = (f"; {f['frozen_share']:.0%} of the parameters frozen (requires_grad=False), a frozen base as adapters "
              f"train beside: {len(f['frozen'])} tensors") if f.get("frozen") else ""
    return (f"one AdamW step lowers the loss ({f['loss_before']:.4g} -> {f['loss_after']:.4g}) and moves every parameter "
            f"with a gradient{zero}{frozen}{_eval_step(f)}")


def _eval_step(f: dict) -> str:
    return "" if f.get("train", True) else " (in eval mode: the training forward's masks do not follow the seed)"


def _other_rate(f: dict, said: str, dropped: str) -> str:
    return (f"says it drops {said} at {f['rate']:g} ({f['where']}), and a training forward drops {dropped} at "
            f"{', '.join(f'{r:g}' for r in f['applied'])} only: the rate it says is not the one it runs (a constant where "
            f"the argument was meant, or another argument passed on)")


MESSAGES = {
    "training.too_large": lambda f: (f"{f['params']:,} parameters, above {f['limit']:,}: this check copies or rebuilds the "
                                     f"whole block several times (gigabytes at a 7B-size layer); run it at a smaller width"),
    "derivative.matches": lambda f: (f"autograd's directional derivatives match central finite differences over "
                                     f"{f['directions']} directions (float64; worst {f['error']:.1e} relative, as far "
                                     f"as the differences spread, or under {f['limit']:g})"),
    "derivative.wrong": _derivative,
    "derivative.surrogate": lambda f: (f"autograd's directional derivative differs from finite differences only along "
                                       f"{names(f['tensors'])}, where the block is flat at every step and jumps when "
                                       f"they move by half their scale: a rounding whose gradient is a straight-through "
                                       f"estimator's surrogate (quantisation-aware training), by design"),
    "derivative.stop_gradient": lambda f: (f"autograd's directional derivative differs from finite differences "
                                           f"(along {names(f['tensors'])}) and agrees once the forward's "
                                           f"{f['detached']} `.detach()` of tensors computed from parameters alone "
                                           f"{'is' if f['detached'] == 1 else 'are'} undone: a stop-gradient on the "
                                           f"weights by design (DoRA's weight norm, a quantiser's scale)"),
    "derivative.no_float64": lambda f: f"a float64 copy does not run: {f['error']}",
    "derivative.layout": lambda f: (f"the backward raises when the gradient reaching the output is not contiguous (laid "
                                    f"out as a transpose after the block leaves it), and runs with the same gradient "
                                    f"contiguous: {f['error']} (a custom backward's .view of its gradient? reshape or "
                                    f".contiguous() first)"),
    "derivative.nonfinite": "the float64 copy's output is not finite",
    "checkpointing.same": _checkpointing_same,
    "checkpointing.differs": _checkpointing_differs,
    "checkpointing.state": lambda f: (f"under {f['how']} a training step leaves other buffers than a plain one: "
                                      f"{names(f['buffers'])} (outputs and gradients agree: the recompute in the backward "
                                      f"updated them a second time, a count or statistic kept in the forward)"),
    "checkpointing.host_streams": lambda f: (f"under non-reentrant checkpointing {f['what']}, and not once Python's and "
                                             f"NumPy's random streams are put back as well: the forward draws from them (a "
                                             f"mask, a layer skip), torch's checkpoint restores only its own, so the "
                                             f"recompute draws anew (other gradients, or a CheckpointError); draw from torch"),
    "checkpointing.input_without_grad": lambda f: (f"with an input that does not require grad these parameters get no gradient "
                                                   f"(reentrant checkpointing inside the block drops them): {names(f['params'])}"),
    "meta_init.no_factory": "the block was handed over as a module instance: there is no factory to build it on the meta device",
    "meta_init.unbuildable": lambda f: f"the block's constructor does not run on the meta device: {f['error']}",
    "meta_init.incomplete_init": lambda f: (f"its own init ({names(f['init']) or 'none'}) leaves parameters unset after a meta-device "
                                            f"build ({names(f['params'])}): the block has no deferred initialisation to judge"
                                            + (f"; buffers it leaves wrong too: {names(f['buffers'])}" if f["buffers"] else "")),
    "meta_init.forward_raises": lambda f: f"built on the meta device and initialised, its forward raises: {f['error']}",
    "meta_init.buffers": lambda f: (f"built on the meta device, materialised and initialised by its own init, these buffers differ "
                                    f"from a normal build's (nothing recomputes them): {names(f['buffers'])}; " + _meta(f)),
    "meta_init.outputs": lambda f: (f"built on the meta device with the normal build's weights loaded, its outputs differ by "
                                    f"{f['diff']:.1e} (limit {f['limit']:g}); " + _meta(f)),
    "meta_init.replaced": lambda f: (f"its own init assigns new Parameters ({names(f['replaced'])}) instead of filling "
                                     f"them in place: they are made on the default device, not the one to_empty chose, "
                                     f"and a tie, an optimizer or a sharding (fully_shard's) made before keeps the old "
                                     f"ones; outputs otherwise a normal build's ({f['diff']:.1e})"),
    "meta_init.same": lambda f: f"built on the meta device and initialised, its {f['checked']} buffer(s) and outputs are a normal build's; " + _meta(f),
    "meta_init.no_buffers": lambda f: "no buffers to compare; with the normal build's weights loaded, its outputs are the same; " + _meta(f),
    "state_dict.load_fails": lambda f: f"loading the block's state_dict into a fresh instance fails: {f['error']}",
    "state_dict.shared": lambda f: (f"a second instance of the block shares {len(f['shared'])} trainable parameter(s) "
                                    f"with the first: {names(f['shared'])} (a module as a default argument, a class "
                                    f"attribute, a module-level cache?): every layer of a stack built from it trains "
                                    f"the same weights"),
    "state_dict.hidden_params": lambda f: f"parameters kept in a Python list or dict (never trained, never saved): {names(f['hidden_params'])}",
    "state_dict.keys": lambda f: (f"load_state_dict(strict=True) into a fresh instance fails: missing {names(f['missing']) or 'none'}; "
                                  f"unexpected {names(f['unexpected']) or 'none'}"),
    "state_dict.outputs": lambda f: (f"a fresh instance loaded with the block's state_dict gives outputs {f['diff']:.1e} away "
                                     f"(limit {f['limit']:g}): state that is not saved" + (f"; plain tensor attributes the forward "
                                     f"reads: {names(f['plain_tensors'])}" if f["plain_tensors"] else "")),
    "state_dict.plain_tensors": _state_plain,
    "state_dict.unseeded": lambda f: (f"two builds at one seed (torch's, Python's and NumPy's) hold different values in "
                                      f"{names(f['built_apart'])}: the construction reads the clock, reseeds a stream "
                                      f"itself (torch.seed()) or leaves memory unwritten (a torch.empty weight no init "
                                      f"fills): runs do not reproduce, and processes that build their own copy (FSDP's "
                                      f"ranks) start apart"),
    "state_dict.other_streams": lambda f: (f"the construction draws from Python's or NumPy's random stream: built again "
                                           f"at the same torch seed with those seeded otherwise, "
                                           f"{names(f['built_apart'])} differ; torch.manual_seed alone does not "
                                           f"reproduce it, and processes seeded by torch alone (FSDP's ranks) build "
                                           f"different weights"),
    "history.instance": "handed over as an instance: no fresh one to hold its calls' history against",
    "history.unrun": "no input but the standard one ran on both (other lengths refused, no padding keyword): no other order to compare",
    "history.unloadable": lambda f: f"a fresh instance does not load the block's state_dict: {f['error']}",
    "history.differs": lambda f: (f"the output depends on earlier calls: on {_HISTORY[f['worst']]} the block and a fresh instance "
                                  f"with the same parameters and buffers differ by {f['diffs'][f['worst']]:.2g} (limit "
                                  f"{f['limit']:.0e}) after other calls before it (a mask or table cached by shape and reused "
                                  f"for another padding mask or length, state kept outside the module's buffers)"),
    "history.same": lambda f: (f"outputs do not depend on earlier calls: the block and a fresh instance agree on "
                               f"{', '.join(_HISTORY[n] for n in f['diffs'])} run in another order (max {f['diffs'][f['worst']]:.1e})"),
    "state_dict.round_trip": lambda f: f"a fresh instance loaded with its state_dict (strict) gives the same outputs (max {f['diff']:.1e})",
    "precision.device": lambda f: f"autocast to bfloat16 is not probed on {f['device']}",
    "precision.unsupported": lambda f: f"the block does not run in bfloat16: {f['error']}",
    "precision.jumps": lambda f: (f"not judged: {'under torch.autocast' if f['how'] == 'autocast' else 'after .to'} "
                                  f"(bfloat16) a tenth of the positions of {f['component']} are exact (error {f['exact']:.1e} or less) and "
                                  f"{f['wrong_first']:.0%} of the first third, {f['wrong_last']:.0%} of the last, are "
                                  f"off by more than {f['limit']:g}: a selection that rounding flips (a top-k over "
                                  f"near-tied keys), not an error that grows along the sequence"),
    "precision.dtype_clash": lambda f: (f"under {f['how']} the block raises on mixing dtypes: {f['error']} (bfloat16 "
                                        f"results meeting float32 tensors: it cannot train so)"),
    "precision.autocast_dtype": lambda f: (f"under torch.autocast (bfloat16) a {f['want']} input comes out {f['got']}: "
                                           f"the residual stream is carried in {f['got']} from this block on (autocast "
                                           f"changes the precision of operations, not the dtype a block returns)"),
    "precision.differs": _precision,
    "precision.close": lambda f: (f"within {f['limit']:g} of float32 at {f['seq']} tokens: autocast {f['errors']['autocast']:.1e}, "
                                  f".to(bfloat16) {f['errors']['to_bfloat16']:.1e} (worst component's relative error per position, 75th percentile)"
                                  f"{_products(f)}"),
    "dropout.attention_ignored": lambda f: (f"says it drops attention's probabilities at {f['rate']:g} ({f['where']}), and a "
                                            f"training forward drops none: "
                                            + ("its SDPA or MultiheadAttention calls ask dropout_p 0" if f["attention_calls"]
                                               else "no dropout reads the softmax's output")
                                            + " (the rate taken, never passed on)"),
    "dropout.attention_rate": lambda f: _other_rate(f, "attention's probabilities", "them"),
    "dropout.residual_ignored": lambda f: (f"says it drops each sublayer's output at {f['rate']:g} ({f['where']}), and a "
                                           f"training forward drops no tensor of the stream's size ({f['dropped']} "
                                           f"dropout calls elsewhere): the rate taken, never applied"),
    "dropout.residual_rate": lambda f: _other_rate(f, "each sublayer's output", "tensors of the stream's size"),
    "dropout.residual_one_branch": lambda f: (f"says it drops each sublayer's output at {f['rate']:g} ({f['where']}), and "
                                              f"its sublayers run in a row (the FFN reads attention's output) while a "
                                              f"training forward drops one tensor of the stream's size: one sublayer's "
                                              f"output goes undropped"),
    "dropout.never_applied": lambda f: (f"built with dropout {f['rate']:g}, a training forward drops nothing: no dropout "
                                        f"of torch's is asked to, and the block draws no mask of its own, while it keeps "
                                        f"{names(f['modules'])} (defined, never called: the rate is ignored)"),
    "dropout.torch_only": lambda f: (f"with torch's own dropouts off, training forwards compute the eval output (within "
                                     f"{f['diff']:.1e}): the block draws no masks of its own"),
    "dropout.train_path": lambda f: (f"with torch's dropouts off, training differs from eval ({f['diff']:.1e}) at dropout 0 "
                                     f"too: a training-only path, not a dropout (see train_eval)"),
    "dropout.rescaled": lambda f: (f"with torch's own dropouts off (the mean of their masks), a training forward differs from "
                                   f"the eval forward by {f['diff']:.1e}, and not at dropout 0: a rescale of the block's own "
                                   f"on top of F.dropout's (dividing by 1 - p twice?), or a mask drawn once and reused"),
    "dropout.on_scores": lambda f: (f"{f['where']}: a training forward sets {f['zeroed']:.0%} of the scores its softmax reads to 0 "
                                    f"and scales the rest by {f['factor']:.3g}: a dropout on the scores before the softmax "
                                    f"(a zeroed score is not a dropped key, which takes -inf, and the rescale sharpens the "
                                    f"weights); drop the probabilities after it"),
    "dropout.stream": lambda f: (f"with every dropout dropping all, the identity path is gone: tr(J)/n {f['gain']:.2f} against "
                                 f"{f['eval_gain']:.2f} in eval (below {f['share']:g} of it): a dropout on the residual stream "
                                 f"(`x = drop(x + f(x))`), not on the branch (`x = x + drop(f(x))`)"),
    "dropout.rate": lambda f: (f"built with dropout={f['asked']:g}, its dropouts run at {names(f'{r:g}' for r in f['ran'])}; built with "
                               f"{f['other']:g}, at {names(f'{r:g}' for r in f['other_ran'])}: a rate that falls as the argument rises "
                               f"(a keep probability passed as the drop rate?)"),
    "dropout.shared": lambda f: (f"on a batch of one sample repeated {f['batch']} times, each of {f['forwards']} training forwards "
                                 f"gives every copy the same output, and no two forwards the same: one dropout mask for the "
                                 f"whole batch (drawn {names(str(tuple(s)) for s in f['shapes'])}, no batch axis first)"),
    "dropout.rare_draws": lambda f: (f"two seeded training forwards agree and differ from eval ({f['diff']:.1e}), yet at dropout "
                                     f"{f['rate']:g} training is random: draws too rare at the block's rate to judge (a "
                                     f"decision per forward, as batch-mode stochastic depth makes)"),
    "dropout.other_noise": "training forwards stay random at dropout 0 (gating noise, jitter): not a dropout to judge",
    "dropout.unsupported": lambda f: f"the block's training forward does not run with torch's dropouts off: {f['error']}",
    "dropout.unjudged": lambda f: (f"{names(f['replaced'])} replace whole samples or rows by one learned value in training "
                                   "(a condition dropped by design, as classifier-free guidance does): not a dropout mask"
                                   if f.get("replaced") else
                                   "no module with random training forwards could be called alone on its eval inputs"),
    "dropout.biased": lambda f: (f"{f['module']}: the mean of {f['masks']} training forwards sits {f['bias']:.2f} of their spread "
                                 f"from the eval output (limit {f['limit']:.2f}), "
                                 + ("smaller: a dropout mask not rescaled by 1/(1-p)?" if f["shrinks"]
                                    else "larger: a dropout rescaled twice?")),
    "dropout.unbiased": lambda f: (f"in expectation over {f['masks']} masks, training forwards compute the eval output "
                                   f"({names(f['judged'])}: bias {f['bias']:.2f} of the spread, limit {f['limit']:.2f})"
                                   + (f"; {names(f['replaced'])} replace samples or rows by a learned value by design"
                                      if f.get("replaced") else "")),
    "optimizer_step.no_params": "the block has no trainable parameters",
    "optimizer_step.loss_not_lowered": lambda f: (f"one AdamW step (lr {f['lr']:g}) does not lower the loss on a fixed target: "
                                                  f"{f['loss_before']:.6g} -> {f['loss_after']:.6g}{_eval_step(f)}"),
    "optimizer_step.tie_broken": lambda f: ("distinct parameters hold the same random values (a tie broken by a copy: they "
                                            "train apart): " + "; ".join(" = ".join(p) for p in f["ties"])),
    "optimizer_step.aliased": lambda f: ("distinct parameters share one storage (`.data` assigned, or a Parameter made of "
                                         "another's tensor), so each optimizer step updates it once per name and weight "
                                         "decay shrinks it as often; tie them as one Parameter (b.weight = a.weight): "
                                         + "; ".join(" = ".join(p) for p in f["aliases"])),
    "optimizer_step.repeated": lambda f: ("one module object sits under several names (entries of a container, or "
                                          "attributes), so they share every parameter and compute the same (`[Head()] * "
                                          "n` builds one head n times, `self.q = self.k = Linear(...)` one projection): "
                                          + "; ".join(" = ".join(g[:4]) + (" = ..." if len(g) > 4 else "")
                                                      for g in f["repeats"])),
    "optimizer_step.unchanged": lambda f: f"one AdamW step leaves parameters with a gradient unchanged: {names(f['unchanged'])}",
    "optimizer_step.symmetric_units": lambda f: (f"{f['where']} ({names(f['modules'])}): {f['distinct']} distinct hidden "
                                                 f"units of {f['units']}; units with equal input rows and output columns "
                                                 f"get equal gradients and stay copies at every step (a constant init "
                                                 f"where a random one was meant?)"),
    "optimizer_step.stuck": lambda f: (f"parameters no step will ever move: {names(f['zeros'])} start at zero, where their "
                                       f"gradient is exactly zero, at init and after a step (given random values, it comes "
                                       f"alive: the zeros hold it)" + _through(f)),
    "optimizer_step.frozen": lambda f: (f"parameters with requires_grad=False (never trained; a norm weight frozen by mistake is a "
                                        f"bug): {names(f['frozen'])}"),
    "optimizer_step.stale": lambda f: (f"after one AdamW step an eval forward without gradients differs from one with "
                                       f"them by {f['stale']:.2g} (limit {f['limit']:g}): the no-grad path computes with "
                                       f"something derived from the parameters before the step (a fused or cached "
                                       f"weight an inference call kept), so validation and generation run old weights"),
    "optimizer_step.ok": _optimizer_ok,
    "grad_accumulation.no_params": "the block has no trainable parameters",
    "grad_accumulation.not_repeatable": lambda f: (f"the same seeded training step gives other gradients each time "
                                                    f"({names(f['params'])}): accumulation cannot be compared"),
    "grad_accumulation.graph_carried": lambda f: (f"after a second training step the block keeps "
                                                  f"{', '.join(f['tensors'])} with an autograd graph that reaches the "
                                                  f"first step's: each step's graph joins the one before (a loss "
                                                  f"summed into an attribute, a state not detached), so memory grows "
                                                  f"with every step and a loss that reads it backpropagates into "
                                                  f"steps already taken"),
    "grad_accumulation.lost": lambda f: (f"two backwards without zeroing do not leave twice one backward's gradient "
                                         f"(worst {f['worst']:.2g} off, limit {f['limit']:g}): {names(f['wrong'])}; "
                                         f"gradient accumulation over micro-batches loses all but the last"),
    "grad_accumulation.interleaved": lambda f: (f"with a second forward run before the first's backward (micro-batches "
                                                f"in flight, pipeline schedules), the first's gradients differ from its "
                                                f"step alone by {f['worst']:.2g} (limit {f['limit']:g}): "
                                                f"{names(f['wrong'])}; the backward reads state the later forward "
                                                f"overwrote (an input stashed on the module, a buffer)"),
    "grad_accumulation.adds": lambda f: (f"gradients add up over two backwards without zeroing ({f['checked']} "
                                         f"parameters, worst {f['worst']:.1e} off), and a forward run in between "
                                         f"leaves a backward's gradients as they were"),
    "global_state.changed": lambda f: "a forward leaves torch's process-wide state changed: " + _switched(f, f["switches"]),
    "global_state.switched": lambda f: ("a forward changes torch's numerics or speed switches for the whole process: "
                                        + _switched(f, f["switches"])),
    "global_state.reseeds": lambda f: ("a forward reseeds the random stream: from two different states it leaves "
                                       + "; ".join(f"{names(s)} in the same one ({m})" for m, s in f["reseeds"].items())
                                       + " (the same dropout masks at every step, the caller's own draws replayed)"),
    "global_state.modes": lambda f: ("a forward switches modules between train and eval: "
                                     + "; ".join(f"{names(s)} in {'an eval' if m == 'eval' else 'a training'} forward"
                                                for m, s in f["modes"].items())
                                     + " (their mode is the caller's: after `model.train()` a dropout the forward turned "
                                       "off stays off, after `model.eval()` one turned on draws at inference)"),
    "global_state.kept": lambda f: ("torch's process-wide switches are as they were after every check"
                                    + ("; no forward reseeds a random stream" if f["rng_probed"] else
                                       " (random streams not probed above the training checks' size)")),
    # train_state
    "train_state.clean": "two train forwards + backwards in a row run; no module state keeps an autograd graph",
    "train_state.second_backward": lambda f: (f"train forward + backward number {f['step']} fails ({f['error']}): module state "
                                              f"written in a training forward carries autograd history"
                                              + (f" ({names(f['held'])})" if f["held"] else "")
                                              + "; detach it, or write it under no_grad"),
    "train_state.inference_path": lambda f: (f"an eval forward under torch.inference_mode() differs from one under "
                                             f"no_grad by {f['diff']:.2g} (limit {f['limit']:g}), on a fresh instance: "
                                             f"a path taken in inference mode only computes something else (a "
                                             f"branch on torch.is_inference_mode_enabled(), a cache it builds)"),
    "train_state.inference_state": lambda f: (f"after an eval forward under torch.inference_mode() (trainer.validate() before fit(), an "
                                              f"eval loop under @torch.inference_mode()) a training step fails ({f['error']}): "
                                              f"state made then is an inference tensor, which autograd will not save and "
                                              f"training may not write"
                                              + (f" ({names(f['kept'])})" if f["kept"] else "")
                                              + "; build it under torch.inference_mode(False), or clone it where training "
                                              "uses it"),
    "train_state.frozen": lambda f: (f"parameters that required grad as the block was built no longer do after the "
                                     f"battery's eval() and train() switches and forwards ({names(f['frozen'])}): an "
                                     f"eval() or forward that freezes them leaves a training loop after a validation "
                                     f"training none of them"),
    "train_state.recompute_writes": lambda f: (f"the backward writes module state the forward wrote ({names(f['written'])}): "
                                               f"a recompute in the backward (activation checkpointing inside the block) "
                                               f"runs the forward's side effects again, so losses kept for the trainer "
                                               f"are appended twice and statistics or counters advance twice per step; "
                                               f"return such a loss rather than keep it, or write the state outside "
                                               f"the checkpointed part"),
    "train_state.history": lambda f: (f"after a train forward the module keeps tensors with autograd history "
                                      f"({names(f['held'])}): module state carries autograd history (a cache written "
                                      f"in training?), which keeps every step's graph alive"),
}

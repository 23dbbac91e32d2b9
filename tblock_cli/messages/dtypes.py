"""The dtype check's words: the run's dtype against a float64 copy, parameters built narrower than the rest, and
activations cast to half precision inside the forward."""

from __future__ import annotations

from tblock_cli.messages.words import names

MESSAGES = {
    "dtype.nonfinite": lambda f: (f"{f['dtype']} output is not finite where float64 is" if f["reference_finite"]
                                  else "not finite in float64 either"),
    "dtype.differs": "{dtype} differs from a float64 copy by relative RMS {error:.2e} > {limit:g}",
    "dtype.agrees": "{dtype} vs a float64 copy: relative RMS error (limit {limit:g})",
    "dtype.narrow_at_build": lambda f: (f"built with {names([f'{n} ({d})' for n, d in f['params'].items()])} among "
                                        f"{f['block']} parameters: tblock ran them as {f['dtype']}; trained as built, "
                                        f"each one's gradient and update round to its own dtype, and FSDP2 refuses "
                                        f"mixed dtypes in one module (a dtype= left in a constructor?)"),
    "dtype.narrowed": lambda f: (f"a {f['dtype']} forward casts an activation to {f['half']} in {f['module']} "
                                 f"(`{f['call']}` of a {f['wide']} tensor"
                                 + (f"; {len(f['calls']) - 1} more such call(s)" if len(f["calls"]) > 1 else "")
                                 + "): half precision written into the code, rounding whatever dtype the block runs in "
                                   "(a hard-coded .half() or autocast?)"),
    "dtype.no_float64": lambda f: f"a float64 copy does not run (code written for float32?): {f['error']}",
}

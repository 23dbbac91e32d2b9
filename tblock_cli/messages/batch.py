"""The batch check's words: samples alone against themselves in a batch, and the batch statistics torch's BatchNorm
shares in training."""

from __future__ import annotations

MESSAGES = {
    "batch.independent": "a sample alone = its output in the batch (max rel. diff {diff:.1e}); no cross-sample gradient",
    "batch.batch_norm": lambda f: (f"a sample alone = its output in the batch (max rel. diff {f['diff']:.1e}); in train mode "
                                   f"samples meet only in BatchNorm's batch statistics ({', '.join(f['norms'])}), by design"),
    "batch.leak": "a sample alone differs from itself in the batch by {diff:.2e} (> {limit:g}): samples leak (eval)",
    "batch.leak_train": lambda f: (f"in train mode sample 0's output has gradient {f['gradient']:.2e} w.r.t. other samples: samples "
                                   f"leak{_stream_batch_norms(f.get('stream_norms'))}"),
}


def _stream_batch_norms(names) -> str:
    return f" (BatchNorm on the residual stream, a LayerNorm's place: {', '.join(names)})" if names else ""

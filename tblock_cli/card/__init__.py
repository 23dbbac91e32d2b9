"""tblock spec: what a block really computes, read black-box from its dataflow and from probes (the card), and the
judge that holds the card against what the block claims to be."""

"""tblock: diagnostics for Transformer blocks: is it correct, how big is it, what does it cost?"""

__version__ = "0.1.0"
__all__ = ["__version__"]

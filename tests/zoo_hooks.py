"""Gradient hooks on parameters, for the training-time checks (which run on copies of the block, and carry the hooks
over: a deep copy drops them): a hook that scales a gradient the forward never asked for, and the correct twin whose
hook only records the gradient's norm."""

from zoo_training import TrainBlock


class HookDoublesGradient(TrainBlock):
    """A hook registered at build doubles the FFN gate's gradient (a loss-scale or clipping helper left behind)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.w1.weight.register_hook(lambda g: g * 2)


class MonitoredGradient(TrainBlock):
    """A hook that records the gate's gradient norm and returns nothing: the gradient is left as autograd made it."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.norms = []
        self.w1.weight.register_hook(lambda g: self.norms.append(g.norm().item()))


PLANTED = {"HookDoublesGradient": "derivative"}
CORRECT = ["MonitoredGradient"]

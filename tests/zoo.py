"""Blocks for testing the battery: correct ones that must pass, and ones with one planted bug each.

Every buggy block is the correct `Good` block with one thing changed; the constructor takes tblock's
keywords (d_model, n_heads, d_ff, dropout, causal) so `--block tests/zoo.py:NAME` builds it.

The blocks live in modules by the property whose check catches them (zoo_forward, zoo_mixing, ...); this
module gathers them under one name, so `--block tests/zoo.py:NAME` and `import zoo` reach every one, and holds
the tables the tests and scripts/zoo_json.py walk.
"""

from zoo_attention import (  # noqa: F401
    AttentionOnly,
    BandRenormalised,
    DiagonalMasked,
    DiagonalMaskedFirstOpen,
    ManualSoftmax,
    NoSoftmax,
    RelativeBiasBeforeSoftmax,
    RelativeBiasOnProbabilities,
    ScaledByDModel,
    ScaledTwice,
    SoftmaxHeadAxisBidirectional,
    SoftmaxOverQueries,
    SoftmaxQueryAxisBidirectional,
    SoftmaxTwice,
    Unscaled,
    UnscaledQKNorm,
    UnscaledSDPA,
)
from zoo_cache import (  # noqa: F401
    CacheChunkSeesFuture,
    CachedLayerScale,
    CachedLlama,
    CachedRoPE,
    CacheForgetsPrefill,
    CacheGrowsGraph,
    CacheKeyTwice,
    CachePromptByLength,
    CacheRoPEOffByOne,
    CacheShared,
    CacheWindow,
    LayerScaleCacheForgetsPrefill,
)
from zoo_correct import (  # noqa: F401
    Conv1D,
    Good,
    GPT2Style,
    HandSoftmax,
    HandSoftmaxPrescaled,
    LlamaBlock,
    NoPadKeyword,
    OpaqueNames,
    ParamFreeQKNorm,
    QKNorm,
    RMSNorm,
    RoPEBlock,
    Rotary,
    ScaledBeforeRotary,
    TorchPostLN,
    TorchPreLN,
    UpcastRMSNorm,
    WideHeadNorms,
    XAttention,
    XEncoder,
    XFeedForward,
    XKeepMask,
    allowed_mask,
    heads,
    merge,
)
from zoo_forward import (  # noqa: F401
    AllocationFails,
    BrokenForward,
    ClampedNormAtZero,
    Counter,
    DropoutInEval,
    EpsZero,
    FailsWithGrad,
    InputMutated,
    InputScaledInPlace,
    LargeInputOverflow,
    NaNForward,
    NeedWeightsOn,
    NoiseInEval,
    PostLNEpsZero,
    PrecisionLoss,
    Printing,
    ReturnsDict,
    RootAtZero,
    TransposedOutput,
    UpcastsOutput,
    WrongShape,
    factory_raises,
    not_a_module,
)
from zoo_gradients import (  # noqa: F401
    DetachedInput,
    FrozenBranch,
    NoFFNResidual,
    NoGradParams,
    NoResidual,
    ResidualFromNorm,
    ResidualTwice,
    UnusedLayer,
)
from zoo_layouts import ConcatenatedQKV, ProjectedMemory, ScaledBeforeRotateHalf, SlicedQKVO  # noqa: F401
from zoo_mixing import (  # noqa: F401
    BatchFirstMixup,
    BatchMeanLeak,
    BatchNormLeak,
    CausalIgnoresPadding,
    CausalOffByOne,
    HeadsNoTranspose,
    HeadsNoTransposeNoMask,
    MaskPolarityZeroRows,
    NotCausal,
    PaddingIgnored,
    PaddingInverted,
    PadMaskOnQueries,
    TokenShift,
    TokenShiftNoMask,
)
from zoo_norms import (  # noqa: F401
    EpsVanishesInHalf,
    GainAppliedTwice,
    GainBeforeStatistics,
    HalfRMSNorm,
    HandLayerNormBlock,
    LengthTemperature,
    NormSquaresInHalf,
    OffsetNormInitOne,
    OnePassVarianceNorm,
    QKBiasAfterRotary,
    QKBiasBeforeRotary,
    QKNormAfterRotary,
    QKNormBeforeRotary,
    UnbiasedVarianceNorm,
)
from zoo_positions import (  # noqa: F401
    GQA3,
    AbsPos3,
    AbsPosNoRestart,
    Alibi3,
    AlibiBeforeScale,
    AlibiHalved,
    AlibiSlopesReversed,
    AlibiWrongSlopes,
    CrossToLatents,
    Fp16Llama3,
    Gemma3,
    GQAKeysOnePositionAhead,
    KeysOnePositionAhead,
    LayerScaleLengthTemperature,
    LayerScaleRoPEValues,
    LayerScaleValuesNotRotatedBack,
    LeftPadNaN,
    Mask3D3,
    PositionsFromOne,
    Rel3,
    RoPEAnglesHalf,
    RoPELayoutMismatch,
    RoPEValues3,
    RoPEValuesSDPA,
    ValuesNotRotatedBack,
    ValuesRotatedSDPA,
    Window3,
    alibi_slopes,
    rope_freqs,
    rotate_half,
    sinusoid,
)
from zoo_safety import (  # noqa: F401
    ClosureCapture,
    EvalReturnsEarly,
    FirstCallInit,
    InferenceModeCache,
    InferenceModeCacheCloned,
    SDPADropoutInEval,
    StepDependentInplace,
    TrainRunningStat,
    TrainStateHistory,
)
from zoo_sharded import (  # noqa: F401
    CapturedWeight,
    FullWidthQKNorm,
    FullWidthQKNormWeighted,
    FusedQKV,
    GlobalHeads,
    HiddenNormFFN,
    LlamaTP,
)
from zoo_structure import (  # noqa: F401
    ActAfterProduct,
    ActOnUp,
    EvalSkipsFFN,
    ExtraParams,
    LinearFFN,
    LinearFFNOpaque,
    NoNormBeforeAttention,
    NoNormBeforeFFN,
    NormOnQueriesOnly,
    PostThenPre,
    RawParams,
    SublayerPostNorm,
    SublayerPostNormMixed,
)

# The bug each planted block carries, and the check that must fail on it (extra flags for the run).
PLANTED = {
    "NoResidual": ("residual", {}),
    "NoFFNResidual": ("residual", {}),
    "UnusedLayer": ("grad_params", {}),
    "FrozenBranch": ("grad_params", {}),
    "NoGradParams": ("grad_params", {}),
    "DetachedInput": ("grad_input", {}),
    "PaddingIgnored": ("padding", {}),
    "PaddingInverted": ("padding", {}),
    "BatchFirstMixup": ("batch", {}),
    "BatchMeanLeak": ("batch", {}),
    "BatchNormLeak": ("batch", {}),
    "DropoutInEval": ("determinism", {}),
    "NoiseInEval": ("determinism", {}),
    "Counter": ("determinism", {}),
    "InputMutated": ("input_unchanged", {}),
    "InputScaledInPlace": ("input_unchanged", {}),
    "EpsZero": ("finite", {}),
    "PostLNEpsZero": ("finite", {}),
    "NaNForward": ("finite", {}),
    "LargeInputOverflow": ("finite", {}),
    "RootAtZero": ("finite", {}),
    "WrongShape": ("shape", {}),
    "TransposedOutput": ("shape", {}),
    "NotCausal": ("causal", {"causal": True}),
    "CausalOffByOne": ("causal", {"causal": True}),
    "SoftmaxOverQueries": ("causal", {"causal": True}),
    "PrecisionLoss": ("dtype", {}),
}


# Warnings, failures only under --strict: need_weights left on (issue #2 asks for a warning).
WARNED = {"NeedWeightsOn": "need_weights"}


# ExtraParams: parameters outside attention, FFN and norms (a position table), not wrong in itself: `ffn_share` says
# where they are and passes
CORRECT = {"Good": {}, "LlamaBlock": {"causal": True}, "TorchPreLN": {}, "TorchPostLN": {}, "NoPadKeyword": {},
           "ExtraParams": {}}


# The second generation: check that must flag each (fail, or warn that --strict fails) and its flags.
PLANTED_2 = {
    "HeadsNoTranspose": ("padding", {}),
    "HeadsNoTransposeNoMask": ("order", {}),
    "TokenShift": ("padding", {}),
    "TokenShiftNoMask": ("order", {}),
    "Unscaled": ("attention", {"d_model": 512, "n_heads": 8}),
    "UnscaledSDPA": ("attention", {}),
    "EvalSkipsFFN": ("train_eval", {}),
    "MaskPolarityZeroRows": ("padding", {}),
    "CausalIgnoresPadding": ("padding", {"causal": True}),
    "LinearFFN": ("ffn_share", {}),
    "LinearFFNOpaque": ("ffn_share", {}),
    "PadMaskOnQueries": ("padding", {}),
}


CORRECT.update({
    "OpaqueNames": {}, "HandSoftmax": {}, "HandSoftmaxPrescaled": {}, "XEncoder": {}, "GPT2Style": {"causal": True},
    "RoPEBlock": {}, "XKeepMask": {"pad_keyword": "mask", "pad_means": "keep"},
})


CACHE_BUGS = ["CacheWindow", "CacheKeyTwice", "CacheRoPEOffByOne", "CacheShared", "CacheChunkSeesFuture", "CacheGrowsGraph",
              "CacheForgetsPrefill", "CachePromptByLength", "LayerScaleCacheForgetsPrefill"]


CACHED_CORRECT = ["CachedLlama", "CachedRoPE", "CachedLayerScale"]


CORRECT["QKNorm"] = {"causal": True}
CORRECT["BandRenormalised"] = {"positional": True}  # a window after the softmax: renormalised, not reweighted
CORRECT["ParamFreeQKNorm"] = {"causal": True}
CORRECT["WideHeadNorms"] = {"causal": True}
CORRECT["ScaledBeforeRotary"] = {"positional": True}
CORRECT["SlicedQKVO"] = {"causal": True}
CORRECT["ScaledBeforeRotateHalf"] = {"positional": True}
CORRECT["ConcatenatedQKV"] = {"causal": True}
CORRECT["ProjectedMemory"] = {"causal": True}
CORRECT["HandLayerNormBlock"] = {}
CORRECT["ClampedNormAtZero"] = {}


PLANTED_2["UnscaledQKNorm"] = ("attention", {"causal": True})


PLANTED_2.update({
    "SoftmaxQueryAxisBidirectional": ("attention", {}),
    "SoftmaxHeadAxisBidirectional": ("attention", {}),
    "DiagonalMasked": ("attention", {"causal": True}),
    "DiagonalMaskedFirstOpen": ("attention", {"causal": True}),
    "SoftmaxTwice": ("attention", {}),
    "ScaledByDModel": ("attention", {}),
    "ScaledTwice": ("attention", {}),
    "ResidualTwice": ("residual", {}),
    "ResidualFromNorm": ("residual", {}),
})


PLANTED_2.update({"NoNormBeforeFFN": ("norm_placement", {}), "NoNormBeforeAttention": ("norm_placement", {}),
                  "PostThenPre": ("norm_placement", {})})


PLANTED_2.update({"NormOnQueriesOnly": ("norm_placement", {}), "UpcastsOutput": ("shape", {})})


CORRECT["RawParams"] = {}


CORRECT["ManualSoftmax"] = {}


PLANTED_2["NoSoftmax"] = ("attention", {})
PLANTED_2["RelativeBiasOnProbabilities"] = ("attention", {})
CORRECT["RelativeBiasBeforeSoftmax"] = {}


# Correct blocks in the ten styles of issue 20 (CachedRoPE: RoPE with a KV cache; Rel3 in bfloat16: RoPE in bf16).
POS = {"positional": True}


CORRECT_3 = {"Rel3": POS, "CachedRoPE": {"causal": True}, "GQA3": POS, "Window3": POS, "Alibi3": POS, "AlibiBeforeScale": POS, "AbsPos3": POS,
             "Mask3D3": POS, "Fp16Llama3": POS, "Gemma3": POS, "RoPEValues3": POS, "FirstCallInit": {},
             "SublayerPostNorm": {"causal": True}, "InferenceModeCacheCloned": POS, "LayerScaleRoPEValues": POS,
             "QKNormBeforeRotary": POS, "QKBiasBeforeRotary": POS, "RoPEValuesSDPA": POS,
             "LengthTemperature": POS, "PositionsFromOne": POS}


# The third generation: name -> (the check that must flag it, its flags; "dtype" names the run dtype it needs).
PLANTED_3 = {
    "RoPELayoutMismatch": ("relative", POS),
    "ValuesNotRotatedBack": ("padding", POS),
    "LayerScaleValuesNotRotatedBack": ("padding", POS),
    "ValuesRotatedSDPA": ("relative", POS),
    "LayerScaleLengthTemperature": ("causal", {"causal": True}),
    "AbsPosNoRestart": ("padding", POS),
    "RoPEAnglesHalf": ("relative", {"dtype": "bfloat16", **POS}),
    "LeftPadNaN": ("padding", {}),
    "NormSquaresInHalf": ("norms", {"dtype": "float16"}),
    "OffsetNormInitOne": ("norms", {}),
    "UnbiasedVarianceNorm": ("norms", {}),
    "OnePassVarianceNorm": ("norms", {}),
    "GainBeforeStatistics": ("norms", {}),
    "GainAppliedTwice": ("norms", {}),
    "EpsVanishesInHalf": ("norms", {}),
    "QKNormAfterRotary": ("relative", POS),
    "QKBiasAfterRotary": ("relative", POS),
    "KeysOnePositionAhead": ("relative", POS),
    "GQAKeysOnePositionAhead": ("relative", POS),
    "AlibiWrongSlopes": ("position_bias", {}),
    "AlibiSlopesReversed": ("position_bias", {}),
    "AlibiHalved": ("position_bias", {}),
    "ActOnUp": ("names", {}),
    "ActAfterProduct": ("names", {}),
    "EvalReturnsEarly": ("train_eval", {}),
    "StepDependentInplace": ("train_state", {}),
    "SublayerPostNormMixed": ("norm_placement", {}),
    "SDPADropoutInEval": ("determinism", {}),
    "ClosureCapture": ("copy", {}),
    "TrainStateHistory": ("train_state", {}),
    "TrainRunningStat": ("train_state", {}),
    "InferenceModeCache": ("train_state", POS),
}


# Correct on one device (the battery passes), and what --tp 2 / --fsdp 2 must say.
DISTRIBUTED = {
    "LlamaTP": {"tp": "pass", "fsdp": "pass"},
    "GlobalHeads": {"tp": "fail", "fsdp": "pass"},
    "FullWidthQKNorm": {"tp": "fail", "fsdp": "pass"},
    "FullWidthQKNormWeighted": {"tp": "fail", "fsdp": "pass"},
    "HiddenNormFFN": {"tp": "fail", "fsdp": "pass"},
    "FusedQKV": {"tp": "refused", "fsdp": "pass"},
    "CapturedWeight": {"tp": "fail", "fsdp": "fail"},
}


CORRECT.update({"LlamaTP": {"causal": True}, "GlobalHeads": {"causal": True}})  # on one device, both are right

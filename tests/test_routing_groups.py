"""Group-limited routing read off the choices a router makes (card/moe.py `group_rules`), held against transformers'
own DeepSeek routers, and the claims that name it (n_group, topk_group, topk_method) with the other routing and width
fields read from configs. The blocks that honour or contradict them are tests/zoo_routing.py's, judged by
test_own_claims.py."""

import pytest
import torch

from tblock_cli.card.entries import Card, Claim, Entry, judge
from tblock_cli.card.groups import group_rules, group_word
from tblock_cli.card.own import own_claims
from tblock_cli.card.own_fit import with_groups


def chosen(idx: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(idx.shape[0], experts, dtype=torch.bool).scatter_(-1, idx, True)


def test_a_limit_written_out_is_the_one_read_and_the_plain_top_k_is_told_from_it():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(40, 8, generator=gen, dtype=torch.float64)
    # 4 contiguous groups of 2 ranked by their best, the best one kept, each token's top 2 inside it
    best = z.view(40, 4, 2).max(-1).values.argmax(-1)
    idx = torch.stack([2 * best, 2 * best + 1], -1)
    assert group_rules(z, chosen(idx, 8), 2) == {(4, 1, "contiguous")}
    # the same limit over strided groups (expert e in group e % 4)
    best = z.view(40, 2, 4).max(-2).values.argmax(-1)
    assert group_rules(z, chosen(torch.stack([best, best + 4], -1), 8), 2) == {(4, 1, "strided")}
    # the plain top 2 of 40 random tokens: no limit that keeps one group of two chooses it
    plain = chosen(z.topk(2, -1).indices, 8)
    assert not any(kept * (8 // groups) == 2 for groups, kept, _ in group_rules(z, plain, 2))
    # a limit that keeps at least k groups ranked by their best always chooses the top k: listed beside "none"
    assert (4, 2, "contiguous") in group_rules(z, plain, 2) and group_word((8, 4, "strided")) == "8/4 strided"


def _hf_choice(router_cls, config_cls, **fields):
    config = config_cls(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        num_attention_heads=4, num_key_value_heads=4, **fields)
    router = router_cls(config).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(48, 16, generator=gen, dtype=torch.float64)
    logits, _, idx = router(x)
    return logits.to(torch.float64), chosen(idx, 16)


def test_transformers_deepseek_routers_are_read_as_their_configs_say():
    pytest.importorskip("transformers")
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    # V3: sigmoid scores, groups ranked by the sum of their two best
    z, routed = _hf_choice(DeepseekV3TopkRouter, DeepseekV3Config)
    assert (4, 2, "contiguous") in group_rules(z, routed, 4)
    assert not bool(chosen(z.topk(4, -1).indices, 16).eq(routed).all())  # the limit shows on these tokens
    # V2's group_limited_greedy: softmax scores, groups ranked by their best; its greedy method: the plain top-k
    z, routed = _hf_choice(DeepseekV2TopkRouter, DeepseekV2Config, topk_method="group_limited_greedy")
    assert (4, 2, "contiguous") in group_rules(z, routed, 4)
    z, routed = _hf_choice(DeepseekV2TopkRouter, DeepseekV2Config, topk_method="greedy")
    assert bool(chosen(z.topk(4, -1).indices, 16).eq(routed).all())
    assert (4, 2, "contiguous") not in group_rules(z, routed, 4)  # some token's top 4 spans three groups


def test_group_claims_and_routing_names_reading_rules():
    def claims(arguments):
        return {c.key: c.value for c in with_groups(own_claims([], arguments))}

    assert claims({"n_group": 8, "topk_group": 4, "topk_method": "noaux_tc"}) == {"moe.groups": "8/4"}
    assert claims({"n_group": 8, "topk_group": 3}) == {"moe.groups": "8/3"}  # dots1, GLM-4.5: no method field
    assert claims({"n_group": 8, "topk_group": 3, "topk_method": "greedy"}) == {}  # DeepSeek-V2-Lite reads neither
    assert claims({"n_group": 1, "topk_group": 1}) == {} and claims({"n_group": 4, "topk_group": 4}) == {}
    assert claims({"n_group": 4}) == {}
    # Kimi's aliases and others' names for the same routing; T5's d_kv and gated switch; Gemma's bidirectional switch
    assert claims({"num_expert_group": 8, "topk_group": 2, "moe_renormalize": True, "num_experts_per_token": 8,
                   "route_scale": 2.5, "moe_topk": 8}) == {"moe.groups": "8/2", "moe.renorm": True, "moe.top_k": 8.0,
                                                           "moe.scale": 2.5}
    assert claims({"d_kv": 64, "is_gated_act": True, "dense_act_fn": "gelu_new"}) == \
        {"attn.head_dim": 64.0, "ffn.gated": True, "ffn.act": "gelu_tanh"}
    assert claims({"use_bidirectional_attention": True}) == {"attn.causal": False}
    # norm_topk_prob=False claims no renormalisation beside a family whose code reads it, and nothing elsewhere
    from tblock_cli.card.own_fit import with_direction, with_renorm_off
    off = lambda arguments: {c.key: c.value for c in with_direction(with_renorm_off(own_claims([], arguments)))}  # noqa: E731
    assert off({"model_type": "qwen2_moe", "norm_topk_prob": False}) == {"moe.renorm": False}
    assert off({"model_type": "mixtral", "norm_topk_prob": False}) == {} and off({"norm_topk_prob": False}) == {}
    assert claims({"use_bidirectional_attention": False, "use_swiglu_ffn": False}) == {"ffn.gated": False}


def test_class_names_that_say_what_an_ffn_computes():
    from tblock_cli.card.own import class_act

    def named(name, module="mine"):
        return class_act(type(name, (), {"__module__": module}))

    assert named("SwiGLU") == (True, "silu") and named("SwiGLUPacked") == (True, "silu")
    assert named("GEGLU") == (True, ("gelu", "gelu_tanh")) and named("ReGLU") == (True, "relu")
    assert named("ReLUSquaredActivation") == (None, "relu2") and named("Squared_ReLU") == (None, "relu2")
    assert named("QuickGELU") == (None, "quick_gelu") and named("NewGELUActivation") == (None, "gelu_tanh")
    assert named("GELUActivation") is None and named("FeedForward") is None and named("GLU") is None
    assert named("SwiGLU", module="torch.nn.modules.custom") is None  # torch's own do what they say
    # timm's and open_clip's act_layer: a class, or a partial of nn.GELU; an instance kept as an attribute says nothing
    import functools

    from tblock_cli.card.own import act_layer
    assert act_layer(torch.nn.GELU) == "gelu" and act_layer(functools.partial(torch.nn.GELU, approximate="tanh")) == "gelu_tanh"
    assert act_layer(type("QuickGELU", (torch.nn.Module,), {})) == "quick_gelu" and act_layer(torch.nn.SiLU()) is None
    assert act_layer(torch.nn.Mish) is None
    assert act_layer(torch.nn.functional.silu) == "silu"  # Megatron's activation_func, a function by its name
    said = lambda arguments: {c.key: c.value for c in own_claims([], arguments)}  # noqa: E731
    assert said({"activation_func": torch.nn.functional.gelu}) == {"ffn.act": "gelu"}
    assert said({"activation": torch.nn.functional.gelu}) == {}  # a bare callable under a generic name: nothing
    card = Card("x", (Entry("ffn.act", "silu"),))
    assert judge(card, (Claim("ffn.act", ("gelu", "gelu_tanh"), "GeGLU"),))[0].status == "differs"
    assert judge(card, (Claim("ffn.act", ("gelu", "silu"), "either"),))[0].status == "match"


def test_a_group_claim_holds_where_it_is_among_the_limits_the_probe_cannot_tell_apart():
    card = Card("x", (Entry("moe.groups", ("none", "4/2", "4/3")),))
    ok, = judge(card, (Claim("moe.groups", "4/2", "said"),))
    off, = judge(card, (Claim("moe.groups", "4/1", "said"),))
    assert ok.status == "match" and off.status == "differs"

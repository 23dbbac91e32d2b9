"""T5's relative-position buckets as a block says it has them (tests/zoo_buckets.py): the steps the claim predicts
against transformers' own bucketing, planted bucket bugs caught by `spec`, their twins clean; a position bias that
saturates attention at init not blamed on q and k; a T5 port's unscaled scores taken as T5's design."""

import pytest
import torch
import zoo_buckets

import tblock_cli
from tblock_cli.card.own_fit import t5_bucket
from tblock_cli.checks import Status

from conftest import TESTS

ZOO = TESTS / "zoo_buckets.py"


def run(name, only, **flags):
    return tblock_cli.check(f"{ZOO}:{name}", d_model=32, n_heads=4, threads=1, only=only, **flags).checks[0]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("buckets, max_distance", [(32, 128), (16, 64), (8, 20)])
def test_the_claimed_buckets_are_transformers_own(bidirectional, buckets, max_distance):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 301)
    theirs = t5.T5Attention._relative_position_bucket(rel, bidirectional, buckets, max_distance).tolist()
    assert [t5_bucket(o, bidirectional, buckets, max_distance) for o in rel.tolist()] == theirs


@pytest.mark.parametrize("name", sorted(zoo_buckets.PLANTED))
def test_a_bucketing_unlike_the_config_fails_spec_on_its_steps(name):
    c = run(name, "spec", causal="Decoder" in name)
    assert c.status is Status.FAIL and [d["key"] for d in c.facts["differs"]] == ["relbias.steps"], c


@pytest.mark.parametrize("name", zoo_buckets.CORRECT)
def test_t5_buckets_as_configured_match(name):
    c = run(name, "spec", causal="Decoder" in name)
    assert c.status is Status.PASS and c.facts["matched"] >= 1, c


def test_attention_saturated_by_a_position_bias_is_not_blamed_on_q_and_k():
    # x-transformers' draw saturates attention through the bias (its q.k part is a correct block's): no warning;
    # projections drawn with std 1 saturate it through q.k: warned, as before
    assert run("LargeBiasDecoder", "attention", causal=True).status is Status.PASS
    hot = tblock_cli.check(f"{TESTS / 'zoo_numerics.py'}:SaturatedInit", d_model=32, n_heads=4, threads=1,
                           only="attention").checks[0]
    assert (hot.status, hot.kind) == (Status.WARN, "attention.saturated"), hot


def test_a_block_whose_config_names_t5_computes_unscaled_scores_by_design():
    # the T5 port keeps a config whose model_type is t5: the family's rule (unscaled, the init folds the scale in)
    c = run("T5Encoder", "attention")
    assert c.status is Status.PASS and c.kind == "by_design" and "t5" in c.detail, c
    # the same scores in a block that names no family are warned of
    bare = tblock_cli.check(Bare(), d_model=32, n_heads=4, threads=1, only="attention").checks[0]
    assert (bare.status, bare.kind) == (Status.WARN, "attention.unscaled"), bare


class Bare(zoo_buckets.T5Encoder):
    def __init__(self, d_model=32, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config.model_type = ""

"""The trained checkpoint's recipes, cheaply: the corpus generator, the recipe keys, the
guess-and-verify decoding and a few optimisation steps. The full run is `make trained-pair`;
the quick pair's training runs in the engine tests' session fixture (tests/conftest.py)."""

import json

import pytest
import torch

from fixtures import tokenizer as tok
from fixtures import trained
from fixtures.tiny import write_checkpoint

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def corpus():
    return trained.Corpus.build()


def test_corpus_is_deterministic(corpus):
    a = trained.sample_sequences(4, seed=7, c=corpus)
    b = trained.sample_sequences(4, seed=7, c=trained.Corpus.build())
    assert [s.ids for s in a] == [s.ids for s in b]
    assert [s.predictable for s in a] == [s.predictable for s in b]
    assert [s.ids for s in a] != [s.ids for s in trained.sample_sequences(4, seed=8, c=corpus)]
    lo, hi = trained.SEQ_LEN
    assert all(lo <= len(s.ids) <= hi for s in a)


def test_corpus_mixes_predictable_and_random_spans(corpus):
    samples = trained.sample_sequences(16, seed=1, c=corpus)
    kinds = {k for s in samples for k in s.kinds}
    assert kinds == set(trained.KINDS)
    flags = [p for s in samples for p in s.predictable]
    assert 0.3 < sum(flags) / len(flags) < 0.8
    for s in samples:
        for i, (kind, pred) in enumerate(zip(s.kinds, s.predictable)):
            if kind == "random":
                assert not pred
            if kind == "up" and pred:  # counting: the digit after the previous one
                d = corpus.digits
                assert d.index(s.ids[i]) == (d.index(s.ids[i - 1]) + 1) % 10
    ids = {i for s in samples for i in s.ids}
    assert ids <= set(corpus.ids)
    assert not ids & {tok.EOS_ID, tok.BOS_ID, tok.PAD_ID, tok.DSPARK_NOISE_TOKEN_ID}


def test_prompts_end_inside_each_kind(corpus):
    prompts = trained.sample_prompts(2, seed=3, c=corpus)
    assert [k for k, _ in prompts] == [k for k in trained.KINDS for _ in range(2)]
    assert prompts == trained.sample_prompts(2, seed=3, c=corpus)
    for kind, ids in prompts:
        assert ids[-1] != corpus.markers[kind] and len(ids) >= 48


def test_recipe_keys_are_stable_and_tell_the_recipes_apart():
    assert set(trained.RECIPES) == {"full", "quick"}
    assert trained.recipe_key() == trained.recipe_key("full") == trained.recipe_key("full")
    keys = {name: trained.recipe_key(name) for name in trained.RECIPES}
    for name, key in keys.items():
        assert key.startswith(f"v{trained.RECIPE_VERSION}-{name}-")
    assert len(set(keys.values())) == len(keys)
    assert trained.checkpoint_dir("full") != trained.checkpoint_dir("quick")
    # every recipe bounds the same figures
    full = trained.RECIPES["full"]
    for recipe in trained.RECIPES.values():
        assert set(recipe) == set(full)
        assert set(recipe["quality_bounds"]) == set(full["quality_bounds"])


def test_few_steps_lower_the_target_loss(tmp_path, corpus):
    torch.manual_seed(0)
    t = trained.Trainer(write_checkpoint(str(tmp_path / "ckpt")), corpus)
    ids = trained.sample_sequences(1, seed=5, c=corpus)[0].ids[:40]
    opt = torch.optim.Adam(t.target_params(), lr=3e-3)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = t.target_loss(ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_finished_report_needs_this_recipe(tmp_path):
    out = str(tmp_path)
    assert trained.finished_report(out) is None
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / trained.FINISHED).write_text(json.dumps({"recipe": "v0-other"}))
    assert trained.finished_report(out) is None  # another recipe: retrain
    (tmp_path / trained.FINISHED).write_text(json.dumps({"recipe": trained.recipe_key()}))
    assert trained.finished_report(out) == {"recipe": trained.recipe_key()}
    assert trained.ensure_trained_pair(out) == out  # reused, no training
    # a directory of one recipe is never taken for the other's
    assert trained.finished_report(out, "quick") is None
    quick = {"recipe": trained.recipe_key("quick")}
    (tmp_path / trained.FINISHED).write_text(json.dumps(quick))
    assert trained.finished_report(out, "quick") == quick
    assert trained.finished_report(out) is None
    assert trained.ensure_trained_pair(out, "quick") == out


def test_guess_and_verify_decoding_is_exact():
    """greedy_decode equals one-token-a-step decoding, whatever the guesses."""

    def next_token(ids):  # a deterministic 'model' with repeats and surprises
        return (ids[-1] * 7 + len(ids) // 5) % 11 if len(ids) % 9 else ids[-3]

    def argmax_rows(ids, k):
        return [next_token(ids[: len(ids) - k + 1 + j]) for j in range(k)]

    prompt = [1, 2, 3, 1, 2, 3, 4]
    slow = list(prompt)
    for _ in range(30):
        slow.append(next_token(slow))
    for hint in ([], slow[len(prompt) :][:12], [5] * 20):
        assert trained.greedy_decode(argmax_rows, prompt, 30, hint) == slow


def _report(loss=1.3, acc=1.0, repeat=1.0, accepted=3.6, ece=0.08):
    kinds = {k: 1.0 for k in trained.KINDS if k != "random"}
    kinds["repeat"] = repeat
    return {
        "target": {
            "heldout_loss": loss,
            "greedy_acc_predictable": acc,
            "greedy_acc_predictable_by_kind": kinds,
        },
        "acceptance": {"mean_accepted_length": accepted, "calibration": {"ece": ece}},
    }


def test_quality_bounds_pass_a_good_run_and_reject_a_bad_one():
    bounds = trained.RECIPES["full"]["quality_bounds"]
    good = trained.require_quality(_report())
    assert good["passed"] and good["bounds"] == bounds
    assert all(c["ok"] for c in good["checks"])
    # the run on another machine that the bounds are there to catch
    bad = _report(loss=2.07, acc=0.70, repeat=0.15)
    assert not trained.quality_check(bad)["passed"]
    with pytest.raises(trained.QualityError) as err:
        trained.require_quality(bad)
    message = str(err.value)
    assert "target.heldout_loss = 2.07" in message
    assert "target.greedy_acc_predictable = 0.7" in message
    assert "target.greedy_acc_predictable_by_kind.repeat = 0.15" in message
    assert "by_kind.up" not in message  # only the figures out of bounds
    low = bounds["mean_accepted_length_min"] - 0.5
    with pytest.raises(trained.QualityError, match="acceptance.mean_accepted_length"):
        trained.require_quality(_report(accepted=low))
    high = bounds["calibration_ece_max"] + 0.05
    with pytest.raises(trained.QualityError, match="acceptance.calibration.ece"):
        trained.require_quality(_report(ece=high))
    missing = _report()
    del missing["target"]["greedy_acc_predictable_by_kind"]["sum"]
    with pytest.raises(trained.QualityError, match="by_kind.sum = None"):
        trained.require_quality(missing)

"""experiments/moeut_first_look.py: its three arms (MoEUT, the same model without shared layers, dense) at MoEUT's
parameter count, and the results page from hand-made records: the figures it reports and the limits it states. No
training (test_grid_pages.py regenerates the committed page)."""

from __future__ import annotations

import json
import math

from helpers.grids import load_experiment

look = load_experiment("moeut_first_look")
STEPS = [50, 100, 150]


def parameters(arm: str) -> int:
    return look.replicate.count_parameters(look.arm_fields(arm)[1], look.SCALE.vocab_size)


def test_switchall_is_moeut_without_shared_layers():
    moeut, switchall = look.arm_fields("moeut")[1], look.arm_fields("switchall")[1]
    repeats = look.SCALE.layers // look.GROUP
    assert moeut["layer_group_size"] == look.GROUP and repeats > 1 and switchall["layer_group_size"] is None
    assert switchall["num_attention_experts"] * repeats == moeut["num_attention_experts"]
    # its experts per block: a share of MoEUT's, trimmed for its own query/key projections and routers
    assert switchall["num_mlp_experts"] <= moeut["num_mlp_experts"] // repeats
    differ = {"layer_group_size", "num_attention_experts", "num_mlp_experts"}
    assert {k: v for k, v in switchall.items() if k not in differ} == {k: v for k, v in moeut.items()
                                                                        if k not in differ}
    assert switchall["layernorm_placement"] == "peri" and switchall["entropy_reg_scope"] == "group"


def test_every_arm_has_moeuts_parameter_count_within_one_percent():
    target = parameters("moeut")
    for arm in ("switchall", "dense"):
        assert abs(parameters(arm) / target - 1) < 0.01, arm
    dense = look.arm_fields("dense")[1]
    assert dense["attention_type"] == "dense" and dense["mlp_type"] == "dense"
    assert dense.get("layer_group_size") is None and dense.get("layernorm_placement", "pre") == "pre"


def test_plan_is_one_seed_of_each_arm_at_one_lr():
    runs, undecided = look.plan({})
    assert [r.name for r in runs] == ["moeut-s0", "switchall-s0", "dense-s0"] and undecided == []
    assert {r.training["learning_rate"] for r in runs} == {look.SCALE.learning_rate}
    assert {r.seed for r in runs} == {0} and not any(r.match for r in runs)


def fake(arm: str, valid: float, test: float) -> dict:
    spec = look.model_spec(arm)
    losses = [math.log(valid) + 0.5 - 0.25 * i for i in range(len(STEPS))]
    per_token = {"moeut": 2.3e6, "switchall": 2.2e6, "dense": 3.1e6}[arm]
    return dict(name=spec.name, model=spec.model, comparison="moeut", role=arm, label=spec.label, seed=0,
                learning_rate=spec.training["learning_rate"], parameters=3_700_000 + len(arm),
                fields=spec.fields, training_settings=dict(vocab_size=8000),
                costs=dict(model_forward_macs=dict(per_token=per_token, total=per_token * 256, lm_head=1024e3 * 256)),
                perplexity=dict(valid=dict(perplexity=valid), test=dict(perplexity=test)),
                train=dict(final_loss=losses[-1]), curve=dict(step=STEPS, loss=losses, valid_step=STEPS,
                                                              valid_loss=losses),
                code=[dict(commit="f" * 40, dirty=[], at="2026-01-01T00:00:00+00:00")], step_seconds_median=5.0,
                cpu_seconds=900.0, wall_seconds=1200.0, timing_complete=True)


def test_results_page_gives_each_arms_figures_and_the_limits(tmp_path):
    out = tmp_path / "out"
    for arm, valid, test in (("moeut", 80.0, 78.0), ("switchall", 82.0, 80.34), ("dense", 79.0, 77.22)):
        (out / f"{arm}-s0").mkdir(parents=True)
        (out / f"{arm}-s0" / look.replicate_cpu.FINISHED).write_text(json.dumps(fake(arm, valid, test)))
    report = look.write_results(out, tmp_path, code=dict(commit="a" * 40, dirty=[]), written="2026-01-01T00:00:00",
                                machine=dict(device="Test CPU", threads=1, python="3", torch="t", transformers="t"))
    page = (tmp_path / "moeut_first_look.md").read_text()
    assert "**Complete: all three runs have finished.**" in page and "Machine: Test CPU (1 torch thread per run" in page
    assert "Python 3, torch t, transformers t." in page and "The runs ran at commit(s) ffffffffffff" in page
    assert "| switchall | 82.00 | 80.34 | +3.0% |" in page and "| dense | 79.00 | 77.22 | -1.0% |" in page
    assert "It **cannot** rank the arms" in page and "one seed" in page.lower()
    assert report["summary"]["moeut"]["non_embedding_parameters"] == 3_700_005 - 2 * 8000 * look.SCALE.d
    assert report["summary"]["dense"]["macs_per_token_without_lm_head"] == 3.1e6 - 1024e3
    # a run not yet finished (and on no committed page) is named as such, without figures
    (out / "dense-s0" / look.replicate_cpu.FINISHED).unlink()
    fresh = tmp_path / "fresh"
    look.write_results(out, fresh, code=dict(commit="a" * 40, dirty=[]), written="2026-01-01T00:00:00",
                       machine=dict(device="Test CPU", threads=1, python="3", torch="t", transformers="t"))
    page = (fresh / "moeut_first_look.md").read_text()
    assert "**Progress: 2 of 3 runs finished.**" in page and "| dense | - | - | - | - |" in page

"""A faithfulness run as data: its numbers, verdicts and report derive from its records; it saves and loads."""

import pytest

from conftest import assert_self_contained
from contribution_lens import faithfulness


def records(effect: float, texts: int = 6) -> list[dict]:
    """Contribution removes what matters ``effect`` nats more than attention does, in comprehensiveness."""
    rows = []
    for seq in range(texts):
        for method, extra in (("attention", 0.0), ("contribution", effect)):
            for ratio in (0.0, 0.5):
                rows.append({
                    "protocol": "every_layer", "task": "gsm8k", "kind": "lm", "seq": str(seq), "method": method,
                    "mode": "comprehensiveness", "ratio": ratio, "tokens": 10,
                    "nll": 20.0 + seq + (5 + extra + 0.1 * seq) * 10 * ratio, "clean": 20.0 + seq,
                })  # fmt: skip
    return rows


SETTINGS = faithfulness.Settings(
    methods=("attention", "contribution"), modes=("comprehensiveness",), ratios=(0.0, 0.5), rank_by="abs"
)
DATA = faithfulness.DataSettings(data=("gsm8k",))


def test_numbers_and_verdicts_derive_from_the_records() -> None:
    run = faithfulness.FaithfulnessRun(records(0.4), SETTINGS, DATA, model_name="m", resamples=200)
    row = run.summary.query("method == 'contribution' and ratio == 0.5").iloc[0]
    assert row["delta_loss"] == pytest.approx(0.5 * (5 + 0.4) + 0.05 * 2.5)
    assert run.verdicts()[["better", "worse", "verdict"]].values.tolist() == [["contribution", "attention", "better"]]
    assert run.verdict_sentences()[0].startswith("contribution is more faithful than attention (comprehensiveness")
    assert "gsm8k" in run.verdict_sentences(with_task=True)[0]
    tie = faithfulness.FaithfulnessRun(records(0.0), SETTINGS, DATA, resamples=200)
    assert tie.verdicts()["verdict"].tolist() == ["indistinguishable"]
    where = "gsm8k — comprehensiveness, masking at every layer"
    assert list(run.figures()) == [f"{where} — delta_loss", f"{where} — delta_ppl"]
    assert "records=24" in repr(run)


def test_save_then_load_gives_the_same_run(tmp_path) -> None:
    run = faithfulness.FaithfulnessRun(records(0.4), SETTINGS, DATA, model_name="m", resamples=200)
    folder = run.save(tmp_path / "run")
    assert sorted(p.name for p in folder.iterdir()) == sorted(faithfulness.results.FILES)
    assert_self_contained((folder / "report.html").read_text())
    loaded = faithfulness.FaithfulnessRun.load(folder, resamples=200)
    assert loaded.settings == SETTINGS and loaded.data == DATA and loaded.model_name == "m"
    assert loaded.records == run.records
    assert loaded.verdicts().equals(run.verdicts())


def test_what_cannot_be_a_run_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="no records: a faithfulness run needs at least one finished condition"):
        faithfulness.FaithfulnessRun([])
    with pytest.raises(FileNotFoundError, match="holds no faithfulness run"):
        faithfulness.FaithfulnessRun.load(tmp_path)
    (tmp_path / "config.json").write_text('{"protocol": {"methods": ["attention"]}}')
    with pytest.raises(ValueError, match=r"config\.json is not a faithfulness run's config"):
        faithfulness.FaithfulnessRun.load(tmp_path)

"""The replication run: the package's own runs, one after the other, in sub-folders of one output folder.

Layout of ``out`` (each part is the folder its own command writes, and its command resumes it):

* ``config.json`` -- the model, the size and the data; a resumed run must match it;
* ``text/`` -- the text faithfulness run (`contribution_lens.faithfulness.run`);
* ``choice-clean/`` -- the multiple-choice sets with nothing removed: clean accuracy against chance;
* ``choice/`` -- the removal run on the sets the model answers above chance;
* ``opening/layer_summary.jsonl`` -- `contribution_lens.layer_summary` of each sink chunk, a line a
  layer, appended as each chunk finishes;
* ``sinks/`` -- `contribution_lens.sink_study` of the first chunks of each text set (`SinkStudy.save`);
* ``claims.json``, ``claims.md``, ``report.html`` -- every claim judged (`Replication`).

Interrupted, the same call resumes: the faithfulness runs skip their finished records, the opening
case its finished chunks, and a saved sink study is loaded instead of recomputed. Under ``torchrun``
every rank takes its share of the faithfulness runs; rank 0 then runs the opening case and the sink
study and writes the claims.
"""

import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens._settings import flags
from contribution_lens.analyses.geometry import layer_summary
from contribution_lens.analyses.sink_claims import FILES as SINK_FILES
from contribution_lens.analyses.sink_claims import SinkStudy, sink_study
from contribution_lens.faithfulness import data as text_data
from contribution_lens.faithfulness import runner
from contribution_lens.faithfulness.results import FaithfulnessRun
from contribution_lens.faithfulness.settings import DataSettings, RunOptions, task_name
from contribution_lens.faithfulness.statistics import accuracy_verdicts
from contribution_lens.files import write_text
from contribution_lens.replication import claims as judged
from contribution_lens.replication.results import Replication
from contribution_lens.replication.settings import (
    SIZES,
    Size,
    choice_settings,
    clean_settings,
    text_settings,
)

PROG = "contribution-lens"
OPENING = Path("opening") / "layer_summary.jsonl"


@dataclass(frozen=True)
class Parts:
    """The settings of each part of a replication, derived from its data and size."""

    data: DataSettings
    size: Size

    @property
    def text(self) -> DataSettings | None:
        """The text run's data; None without a text set (the part does not run)."""
        return self._sets(self.data.lm)

    @property
    def clean(self) -> DataSettings | None:
        """The clean run's data; None without a multiple-choice set (the part does not run)."""
        return self._sets(self.data.choice)

    def choice(self, tasks: Sequence[str]) -> DataSettings | None:
        """The removal run's data: the multiple-choice sets of ``tasks`` (those above chance); None if none is."""
        return self._sets(tuple(s for s in self.data.choice if task_name(s) in tasks))

    def _sets(self, specs: tuple[str, ...]) -> DataSettings | None:
        # A part runs on its own sets only: none given, there is nothing to build (DataSettings refuses no data).
        return replace(self.data, data=specs, choice_ratios=None) if specs else None

    @property
    def choice_ratios(self) -> tuple[float, ...]:
        return self.data.choice_ratios or self.size.choice_ratios

    @property
    def sink_chunks(self) -> int:
        """Chunks per text set in the sink study and the opening case (at most the text run's)."""
        limit = self.data.max_chunks
        return self.size.sink_chunks if limit is None else min(self.size.sink_chunks, limit)


def part_commands(
    parts: Parts, out: Path, model_flags: Sequence[str], options: RunOptions, above: Sequence[str] | None = None
) -> dict[str, str]:
    """The command that reproduces (or resumes) each part in its own folder ("" for a part that does not run).

    ``above``: the multiple-choice tasks the removal run takes (default: every one given).
    """
    run_flags = flags(options)

    def faithfulness(settings: Any, data: DataSettings | None, folder: str) -> str:
        if data is None:
            return ""
        words = [PROG, "faithfulness", *model_flags, *flags(settings), *flags(data), *run_flags, "--out", out / folder]
        return shlex.join(map(str, words))

    above = _tasks(parts.data.choice) if above is None else above
    sinks: list[Any] = [PROG, "sinks", *model_flags, *[word for spec in parts.data.lm for word in ("--data", spec)]]
    sinks += ["--chunk-length", parts.data.chunk_length, "--max-chunks", parts.sink_chunks]
    if parts.data.prepend_bos is not None:
        sinks += ["--prepend-bos", "yes" if parts.data.prepend_bos else "no"]
    sinks += ["--batch-size", parts.data.batch_size, "--out", out / "sinks"]
    replicate = [PROG, "replicate", *model_flags, "--size", parts.size.name, *flags(parts.data), *run_flags]
    return {
        "text": faithfulness(text_settings(parts.size), parts.text, "text"),
        "choice-clean": faithfulness(clean_settings(), parts.clean, "choice-clean"),
        "choice": faithfulness(choice_settings(parts.choice_ratios), parts.choice(above), "choice"),
        "sinks": shlex.join(map(str, sinks)) if parts.data.lm else "",
        "replicate": shlex.join(map(str, [*replicate, "--out", "NEW_FOLDER"])),
    }


def _tasks(specs: Sequence[str]) -> list[str]:
    return [task_name(spec) for spec in specs]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def check_config(out: Path, config: dict[str, Any]) -> None:
    """Keep ``config.json`` unless a finished part disagrees: a replication resumes only its own settings."""
    path = out / "config.json"
    if path.is_file():
        previous = json.loads(path.read_text(encoding="utf-8"))
        if previous != config:
            raise ValueError(f"{out} holds a replication with other settings ({path}); use another --out folder")
        return
    if _rank() == 0:
        write_text(path, json.dumps(config, indent=2, sort_keys=True))


def run(
    model: adapter.Model,
    data: DataSettings,
    out: str | os.PathLike,
    *,
    size: Size | str = "quick",
    options: RunOptions | None = None,
    model_name: str = "",
    model_flags: Sequence[str] = (),
    progress: bool = True,
) -> Replication | None:
    """Measure every claim on ``model``: its `Replication` on rank 0 (None on the others).

    Args:
        data: the text sets (``gsm8k``, ``fineweb``, ``text``) and multiple-choice sets (``mmlu``,
            ``winogrande``, ``boolq``) with their sizes (`contribution_lens.replication.data_settings`
            fills them from ``size``).
        size: a `Size` or its name in `SIZES` (the ratios and the sink study's chunks).
        model_flags: the command line's ``--model``/``--device``/``--dtype`` words, for each claim's
            command (default: ``--model model_name``).
    """
    size = SIZES[size] if isinstance(size, str) else size
    options = options or RunOptions()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = Parts(data, size)
    flags_ = list(model_flags) or (["--model", model_name] if model_name else [])
    check_config(out_dir, {"model": model_name, "size": size.name, "data": data.to_dict()})

    def part(settings: Any, part_data: DataSettings | None, folder: str, label: str) -> FaithfulnessRun | None:
        if part_data is None:  # no set of this part's kind was given
            return None
        return runner.run(model, settings, part_data, out_dir / folder, options=options, model_name=model_name,
                          progress=progress, label=label)  # fmt: skip

    text = part(text_settings(size), parts.text, "text", "text faithfulness")
    clean = removal = None
    above: list[str] = []
    if data.choice:
        clean = part(clean_settings(), parts.clean, "choice-clean", "clean accuracy")
        clean = clean or FaithfulnessRun.load(out_dir / "choice-clean", resamples=options.resamples)
        accuracy = clean.tables.accuracy
        above = sorted(set(accuracy.loc[accuracy["above_chance"].astype(bool), "task"]))
        removal = part(choice_settings(parts.choice_ratios), parts.choice(above), "choice", "multiple-choice removal")
    if _rank() != 0:
        return None
    commands = part_commands(parts, out_dir, flags_, options, above)
    chunks = (
        text_data.text_chunks(
            model, data.lm, length=data.chunk_length, max_chunks=parts.sink_chunks, prepend_bos=data.prepend_bos
        )
        if data.lm
        else None
    )
    summaries = opening_summaries(model, chunks, out_dir / OPENING, progress=progress) if chunks is not None else None
    study = sinks(model, chunks, out_dir / "sinks", batch_size=data.batch_size, model_name=model_name,
                  progress=progress) if chunks is not None else None  # fmt: skip
    found = judge(text, clean, removal, summaries, study, commands, resamples=options.resamples)
    tables = report_tables(text, [run for run in (clean, removal) if run is not None], summaries, study)
    weight = next(iter(model.parameters()))
    result = Replication(found, model_name, size.name, data.to_dict(), commands, tables, str(weight.device),
                         str(weight.dtype).removeprefix("torch."))  # fmt: skip
    result.save(out_dir)
    return result


def report_tables(
    text: FaithfulnessRun | None,
    choice: Sequence[FaithfulnessRun],
    summaries: pd.DataFrame | None,
    study: SinkStudy | None,
) -> dict[str, pd.DataFrame]:
    """What the report shows beside the claims: AOPC, accuracy, the opening case per layer, the sink per head."""
    tables = {}
    if text is not None:
        tables["aopc"] = text.aopc()
    if choice:
        tables["accuracy"] = pd.concat([run.tables.accuracy for run in choice], ignore_index=True)
    if summaries is not None and not summaries.empty:
        columns = ["sink_attention", "sink_contribution", "negative_share", "top1_agreement"]
        tables["opening"] = summaries.groupby("layer")[columns].mean().reset_index()
    if study is not None:
        wanted = [c for c in ("sink_ratio", "intra_sink_attention", "intra_sink_contribution") if c in study.heads]
        tables["sink_heads"] = study.heads[wanted].reset_index()
    return tables


def opening_summaries(model: adapter.Model, chunks: Any, path: Path, *, progress: bool = True) -> pd.DataFrame:
    """`layer_summary` of each chunk (a ``text`` column numbers them), resumed from ``path``'s finished lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    done = {row["text"] for row in rows}
    with open(path, "a", encoding="utf-8") as stream:
        for index in tqdm(range(chunks.shape[0]), desc="opening case (layer summaries)", disable=not progress):
            if index in done:
                continue
            table = layer_summary(model, chunks[index : index + 1]).reset_index()
            new = [{"text": index, **row} for row in table.to_dict("records")]
            stream.write("".join(json.dumps(row) + "\n" for row in new))
            stream.flush()
            os.fsync(stream.fileno())
            rows += new
    return pd.DataFrame(rows)


def sinks(
    model: adapter.Model, chunks: Any, folder: Path, *, batch_size: int, model_name: str, progress: bool = True
) -> SinkStudy:
    """The sink study of ``chunks``, read back from ``folder`` where a finished one was saved."""
    if (folder / SINK_FILES["study"]).is_file():
        return SinkStudy.load(folder)
    study = sink_study(model, chunks, batch_size=batch_size, model_name=model_name, progress=progress)
    study.save(folder)
    return study


def judge(
    text: FaithfulnessRun | None,
    clean: FaithfulnessRun | None,
    removal: FaithfulnessRun | None,
    summaries: pd.DataFrame | None,
    study: SinkStudy | None,
    commands: dict[str, str],
    *,
    resamples: int = 1000,
) -> list[judged.Claim]:
    """Every claim of `contribution_lens.replication.claims.STATEMENTS`, in order, from the parts' results."""
    found: list[judged.Claim] = []
    no_text = "no text data given (--data gsm8k=PATH, --data fineweb=PATH)"
    if summaries is not None:
        heads = study.heads if study is not None else None
        found.append(judged.opening_claim(summaries, heads, command=commands["replicate"], resamples=resamples))
    else:
        found.append(judged.no_verdict("opening_case", no_text, commands["replicate"]))
    if text is not None:
        verdicts = text.verdicts()
        found.append(judged.chain_claim(verdicts, command=commands["text"]))
        for claim_id, (better, worse) in judged.PAIRS.items():
            found.append(judged.pair_claim(claim_id, verdicts, better, worse, command=commands["text"]))
    else:
        found += [
            judged.no_verdict(claim_id, no_text, commands["text"]) for claim_id in ("hierarchy_chain", *judged.PAIRS)
        ]
    accuracy = clean.tables.accuracy if clean is not None else pd.DataFrame(columns=["task"])
    verdicts = accuracy_verdicts(removal.frame, resamples=resamples) if removal is not None else None
    for task in ("mmlu", "winogrande", "boolq"):
        found.append(judged.downstream_claim(task, accuracy, verdicts, command=commands["choice"],
                                             clean_command=commands["choice-clean"]))  # fmt: skip
    if study is not None:
        found += judged.sink_claims(study.heads, study.claims, study.verdicts(), study.per_layer(),
                                    command=commands["sinks"], resamples=resamples)  # fmt: skip
    else:
        sink_ids = [claim_id for claim_id in judged.STATEMENTS if claim_id.startswith("sink_")]
        found += [judged.no_verdict(claim_id, no_text, commands["sinks"]) for claim_id in sink_ids]
    return found

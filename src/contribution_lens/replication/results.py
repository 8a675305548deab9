"""A replication's result: every claim judged, with the tables behind them; saved as JSON, Markdown and HTML.

`Replication` has the package's one result lifecycle: `Replication.save` writes
``replication.safetensors`` through `contribution_lens.files.save_result` (what `Replication.load`
reads back), and beside it what people and scripts read: ``claims.json`` (every claim, its number,
interval, verdict, line, command and cells, plus the tables), ``claims.md`` (the same for a reader)
and ``report.html`` (`Replication.report`: the claims first, then the figures and tables).
"""

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from contribution_lens.files import file_name, load_result, reading, save_result, write_text
from contribution_lens.replication.claims import VERDICTS, Cell, Claim

FORMAT = "contribution_lens.Replication/1"
FILES = ("claims.json", "claims.md", "report.html", "replication.safetensors")


def _interval(claim: Claim) -> str:
    if claim.number is None or claim.low is None or claim.high is None:
        return ""
    return f"{claim.number:+.4g} [{claim.low:+.4g}, {claim.high:+.4g}]"


@dataclass
class Replication:
    """Every claim judged on one model, with the tables behind them.

    Attributes:
        claims: in `contribution_lens.replication.claims.STATEMENTS`'s order.
        tables: ``aopc`` (text run), ``accuracy`` (clean and under removal), ``opening`` (per
            layer), ``sink_heads`` (per head): what the report shows beside the claims.
    """

    claims: list[Claim]
    model_name: str = ""
    size: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    device: str = ""
    """Where the model's weights were (``cuda:0``, ``cpu``) and their dtype, as the run found them."""
    dtype: str = ""

    def __repr__(self) -> str:
        counts = {kind: sum(c.kind == kind for c in self.claims) for kind in VERDICTS}
        shown = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
        return f"Replication(model={self.model_name!r}, size={self.size!r}, claims={len(self.claims)}: {shown})"

    def __getitem__(self, claim_id: str) -> Claim:
        for claim in self.claims:
            if claim.id == claim_id:
                return claim
        raise KeyError(f"no claim {claim_id!r}; the claims are {', '.join(c.id for c in self.claims)}")

    def to_dataframe(self) -> pd.DataFrame:
        """One row a claim: id, claim, verdict, number, ci_low, ci_high, line, command."""
        return pd.DataFrame(
            [
                {"id": c.id, "claim": c.statement, "verdict": c.verdict, "number": c.number, "ci_low": c.low,
                 "ci_high": c.high, "line": c.line, "command": c.command}
                for c in self.claims
            ]
        )  # fmt: skip

    def cells(self) -> pd.DataFrame:
        """Every setting a claim was judged in: claim, setting, number, interval, the library's verdict."""
        rows = [
            {"claim": c.id, "setting": cell.where, "number": cell.number, "ci_low": cell.low, "ci_high": cell.high,
             "verdict": cell.verdict, "line": cell.line}
            for c in self.claims for cell in c.cells
        ]  # fmt: skip
        return pd.DataFrame(rows, columns=["claim", "setting", "number", "ci_low", "ci_high", "verdict", "line"])

    def markdown(self) -> str:
        """``claims.md``: a table of the claims, then each claim's line, settings and command."""
        lines = [
            f"# The paper's claims on {self.model_name or 'this model'} (size {self.size})",
            "",
            "Each number is followed by its 95 % interval; a claim judged in several settings shows its weakest.",
            "",
            "| claim | number [95 % interval] | verdict |",
            "|---|---|---|",
        ]
        lines += [f"| {c.statement} | {_interval(c)} | {c.verdict} |" for c in self.claims]
        for c in self.claims:
            lines += ["", f"## {c.id}: {c.verdict}", "", c.statement + ".", "", f"- {c.line}"]
            lines += [f"- {cell.line} → {cell.verdict}" for cell in c.cells]
            if c.command:
                lines += ["", "```bash", c.command, "```"]
        return "\n".join(lines) + "\n"

    def figures(self) -> dict[str, go.Figure]:
        """The opening case per layer and per head (where the tables hold them), by title."""
        from contribution_lens.drawing import plot

        figures: dict[str, go.Figure] = {}
        opening = self.tables.get("opening")
        if opening is not None and not opening.empty:
            series = {name: opening[name].tolist() for name in ("sink_attention", "sink_contribution")}
            title = "The opening case: the first token's attention and contribution per layer"
            figures[title] = plot.lines(series, title="first token, mean over texts", x=list(opening["layer"]))
        heads = self.tables.get("sink_heads")
        if heads is not None and not heads.empty:
            table = heads.set_index(["layer", "head"])
            for column in ("intra_sink_attention", "intra_sink_contribution"):
                if column in table:
                    figures[f"Per head: {column}"] = plot.sink_head_grid(table, column)
        return figures

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: the claims judged, every setting, the figures, the tables, the commands."""
        from contribution_lens.drawing import html

        intro = (
            f"Model {self.model_name or '(unnamed)'} ({self.dtype} on {self.device}), size {self.size}. "
            "Verdicts: supported (every setting), "
            "partly (some), not supported (none), no verdict (nothing to judge: no data, or the model is at "
            "chance on the task). A claim judged in several settings shows its weakest setting's number."
        )
        claims = self.to_dataframe().drop(columns=["command"])
        sections: list[html.Section] = [("How to read this page", intro), ("The claims", claims)]
        if not self.cells().empty:
            sections.append(("Every setting", self.cells()))
        sections += list(self.figures().items())
        for name, title in (("aopc", "AOPC of the text run"), ("accuracy", "Multiple-choice accuracy")):
            table = self.tables.get(name)
            if table is not None and not table.empty:
                sections.append((title, table))
        sections.append(("The commands", pd.DataFrame({"command": self.commands})))
        return html.write_html(path, f"The paper's claims on {self.model_name or 'this model'}", sections)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model_name,
            "size": self.size,
            "device": self.device,
            "dtype": self.dtype,
            "data": self.data,
            "verdicts": list(VERDICTS),
            "claims": [claim.to_dict() for claim in self.claims],
            "commands": self.commands,
            "tables": {name: json.loads(table.to_json(orient="records")) for name, table in self.tables.items()},
        }

    def save(self, folder: str | os.PathLike) -> Path:
        """Write `FILES` into ``folder`` (each atomically); returns the folder."""
        out = Path(folder)
        if out.is_file():
            raise ValueError(f"{out} is a file: a replication is saved as a folder ({'/'.join(FILES)})")
        out.mkdir(parents=True, exist_ok=True)
        save_result(out / file_name(type(self)), self, example=file_name(type(self)))
        write_text(out / "claims.json", json.dumps(self.to_dict(), indent=2, allow_nan=False))
        write_text(out / "claims.md", self.markdown())
        self.report(out / "report.html")
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "Replication":
        """A replication written by `save` (its ``replication.safetensors``; else, from a run saved
        before that file was written, its ``claims.json``)."""
        stored = Path(folder) / file_name(cls)
        if stored.is_file():
            return load_result(stored, cls)
        path = Path(folder) / "claims.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no replication (no claims.json)")
        with reading(path, "a replication's claims.json written by Replication.save"):
            saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("format") != FORMAT:
            raise ValueError(f"{path} was not written by Replication.save")
        names = {f.name for f in fields(Claim)}
        found = []
        for entry in saved["claims"]:
            values = {name: entry[name] for name in names if name in entry}
            values["verdict"] = f"no verdict: {entry['reason']}" if entry.get("reason") else entry["verdict"]
            values["cells"] = tuple(Cell(**cell) for cell in entry.get("cells", ()))
            found.append(Claim(**values))
        tables = {name: pd.DataFrame(rows) for name, rows in saved.get("tables", {}).items()}
        return cls(
            found, saved["model"], saved["size"], saved["data"], saved["commands"], tables,
            saved.get("device", ""), saved.get("dtype", ""),
        )  # fmt: skip

"""Why a head attends, on the bundled models: the known answers of ``cl.qk_attribution``, printed as tables.

Three questions, each answered from one text with the public API (the numbers on the documentation's
*Measured results* page come from this script; ``tests/analyses/test_qk_attribution.py -m slow -k
"induction or sink"`` checks the counts):

* **Induction (K-composition).** 20 random token ids (seed 0, ids 1000-9999) repeated once after BOS.
  An induction head gives more than 0.3 of its attention, on average over the second copy, to the
  token after the current token's first occurrence; for each, the component with the largest mean
  key-side advantage at that key, the runner-up, and the component's previous-token score where it
  is a head (mean attention to the token before).
* **The sink.** On a plain text, every head of ``--sink-layers`` that gives key 0 more than 0.8 of its
  attention (queries 4 on): the component with the largest mean key-side advantage at key 0, its mean
  raw term ``K_i0``, and the largest raw term of any other component.
* **Previous-token heads.** ``--previous`` heads on the same text: attention to ``i - 1``, the mean total
  advantage there and its largest components on both sides.

Run: ``python benchmarks/qk_known_answers.py`` (both bundled decoders; 62 s of CPU, 4 minutes on a
loaded machine) or ``--model smollm2``.
"""

import argparse
import re
from typing import Any

import pandas as pd
import torch

import contribution_lens as cl

SINK_TEXT = (
    "The quick brown fox jumps over the lazy dog. Alice went to the market to buy apples, and Bob stayed home to "
    "read a book."
)
MODELS = {
    "smollm2": (None, [14, 21, 26], [(16, 0), (1, 2)]),
    "gemma3-270m": ("gemma3-270m", [1, 5, 17], [(2, 3)]),
}


def as_head(name: str) -> tuple[int, int] | None:
    found = re.fullmatch(r"L(\d+)H(\d+)", name)
    return None if found is None else (int(found.group(1)), int(found.group(2)))


def ranked(values: torch.Tensor, names: tuple[str, ...]) -> pd.Series:
    return pd.Series(values.double().numpy(), index=list(names)).sort_values(ascending=False)


def induction(model: Any, length: int = 20, threshold: float = 0.3) -> pd.DataFrame:
    """One row per induction head: its largest key-side advantage at the induction key (mean over the 2nd copy)."""
    first = torch.randint(1000, 10000, (length,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([torch.tensor([model.tokenizer.bos_token_id]), first, first])
    second = torch.arange(length + 1, len(ids))
    keys, positions = second - length + 1, torch.arange(2, len(ids))

    def scores(layer: cl.LayerInputs) -> torch.Tensor:
        pattern = layer.pattern[0]
        return torch.stack([pattern[:, second, keys].mean(-1), pattern[:, positions, positions - 1].mean(-1)])

    found = cl.map_layers(model, ids, scores)
    stacked = torch.stack([found[layer] for layer in found.layers])  # [layer 2 head]
    score, previous = stacked[:, 0], stacked[:, 1]
    rows = []
    for layer in sorted({layer for layer, _ in (score > threshold).nonzero().tolist()}):
        heads = (score[layer] > threshold).nonzero().flatten().tolist()
        split = cl.qk_attribution(model, ids, layer, heads, query=second.tolist())
        for head in heads:
            at_key = split.advantage("key", head=head)[torch.arange(length), :, keys]  # [query component]
            mean = ranked(at_key.mean(0), split.key_components)
            wins = int((at_key.argmax(1) == split.key_components.index(mean.index[0])).sum())
            source = as_head(mean.index[0])
            rows.append({
                "head": f"L{layer}H{head}", "induction score": round(score[layer, head].item(), 2),
                "largest key side": mean.index[0], "mean": round(mean.iloc[0], 2),
                f"largest at (of {length})": wins, "runner-up": f"{mean.index[1]} {mean.iloc[1]:.2f}",
                "its previous-token score": None if source is None else round(previous[source].item(), 2),
            })  # fmt: skip
    return pd.DataFrame(rows)


def sink(model: Any, layers: list[int], threshold: float = 0.8) -> pd.DataFrame:
    """One row per head of ``layers`` parking on key 0: what gives key 0 its advantage (mean over queries 4 on)."""
    shares = cl.map_layers(model, SINK_TEXT, lambda layer: layer.pattern[0][:, 4:, 0].mean(-1))
    parking = torch.stack([shares[layer] for layer in shares.layers])
    queries = list(range(4, len(shares.str_tokens[0])))
    rows = []
    for layer in layers:
        heads = (parking[layer] > threshold).nonzero().flatten().tolist()
        if not heads:
            continue
        split = cl.qk_attribution(model, SINK_TEXT, layer, heads, query=queries)
        for head in heads:
            advantage = ranked(split.advantage("key", head=head)[:, :, 0].mean(0), split.key_components)
            raw = ranked(split.terms("key", head=head)[0, :, :, 0].mean(0), split.key_components)
            other = raw.drop(advantage.index[0]).abs().idxmax()
            rows.append({
                "head": f"L{layer}H{head}", "attention to key 0": round(parking[layer, head].item(), 3),
                "largest advantage": advantage.index[0], "mean": round(advantage.iloc[0], 2),
                "total advantage": round(advantage.sum(), 2), "its raw term": round(raw[advantage.index[0]], 2),
                "largest other raw term": f"{other} {raw[other]:.2f}",
            })  # fmt: skip
    print(f"heads parking on key 0 (> {threshold}): {int((parking > threshold).sum())} of {parking.numel()}")
    return pd.DataFrame(rows)


def previous_token(model: Any, heads: list[tuple[int, int]]) -> pd.DataFrame:
    """One row per head: the mean advantage at key ``i - 1`` (queries 4 on), in total and its largest components."""
    rows = []
    for layer, head in heads:
        split = cl.qk_attribution(model, SINK_TEXT, layer, head, query=None)
        queries = torch.arange(4, len(split.str_tokens))
        key = ranked(split.advantage("key")[queries, :, queries - 1].mean(0), split.key_components)
        query = ranked(split.advantage("query")[queries, :, queries - 1].mean(0), split.query_components)
        share = split.pattern[0, queries, queries - 1].mean().item()
        rows.append({
            "head": f"L{layer}H{head}", "attention to i-1": round(share, 2), "total advantage": round(key.sum(), 2),
            "key side": ", ".join(f"{name} {value:.2f}" for name, value in key.head(4).items()),
            "query side": ", ".join(f"{name} {value:.2f}" for name, value in query.head(3).items()),
        })  # fmt: skip
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append", help="default: both")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 80):
        for name in args.model or sorted(MODELS, reverse=True):
            model_name, sink_layers, previous_heads = MODELS[name]
            model = cl.load_model() if model_name is None else cl.load_model(model_name)
            print(f"\n== {name}: induction heads (K-composition)\n{induction(model).to_string(index=False)}")
            print(f"\n== {name}: what makes the sink attractive (layers {sink_layers})")
            print(sink(model, sink_layers).to_string(index=False))
            print(f"\n== {name}: previous-token heads\n{previous_token(model, previous_heads).to_string(index=False)}")


if __name__ == "__main__":
    main()

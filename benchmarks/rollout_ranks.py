"""Where the rollouts put a prediction's input tokens: the first token's share and rank.

For the prediction protocol's texts (``[BOS, t_1, ..., t_{n-1}]`` chunks of the joined documents,
explained position ``n - 2``), the last layer's rollout row of that position is each input
token's share of its residual stream. This prints, per measure, the mean share of position 0,
how often position 0 ranks first, and the mean position of the top 10 % of the other keys (the
ones ``--ratios 0.1`` deletes). It reads the numbers the measured results page (``docs/results.md``)
uses to say why attention rollout falls below random there. Run (seconds on 2 cores)::

    python benchmarks/rollout_ranks.py --data gsm8k=../shared/data/gsm8k/test.jsonl --max-chunks 48
"""

import argparse

import torch

from contribution_lens import adapter
from contribution_lens.faithfulness import data
from contribution_lens.faithfulness.protocols import explained_positions
from contribution_lens.loading import load_model
from contribution_lens.methods.rollout import attention_rollout_scores, flow_scores

MEASURES = {"attention_rollout": attention_rollout_scores, "flow": flow_scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", required=True, help="NAME=PATH, as for contribution-lens faithfulness")
    parser.add_argument("--max-chunks", type=int, default=48)
    parser.add_argument("--chunk-length", type=int, default=64)
    args = parser.parse_args()
    model = load_model(args.model)
    tokenizer = model.tokenizer
    chunks = data.chunk_tokens(
        tokenizer,
        data.load_texts(args.data),
        length=args.chunk_length,
        bos_token_id=int(tokenizer.bos_token_id),
        max_chunks=args.max_chunks,
    )
    mask = torch.ones_like(chunks, dtype=torch.bool)
    batch = adapter.TokenBatch(chunks, mask, [tokenizer.convert_ids_to_tokens(row) for row in chunks.tolist()])
    last = model.cfg.n_layers - 1
    print(f"{args.model}, {chunks.shape[0]} texts of {args.chunk_length} tokens, last layer's rollout row")
    for name, scores_of in MEASURES.items():
        with torch.inference_mode():
            rollout = scores_of(model, batch, [last])[last]
        explained = explained_positions(mask[:, None].expand(-1, chunks.shape[1], -1))
        rows = rollout[torch.arange(chunks.shape[0]), explained].abs()
        rows[torch.arange(chunks.shape[0]), explained] = -1  # the explained position is never deleted
        share = rollout[torch.arange(chunks.shape[0]), explained, 0]
        first = rows.argmax(-1) == 0
        k = max(1, round(0.1 * (chunks.shape[1] - 1)))
        others = rows[:, 1:].topk(k, dim=-1).indices + 1
        print(
            f"  {name:18s} share of position 0: {share.mean():.4f}; ranked first in {first.float().mean():.0%};"
            f" mean position of the other top {k}: {others.float().mean():.1f} of {chunks.shape[1] - 2}"
        )


if __name__ == "__main__":
    main()

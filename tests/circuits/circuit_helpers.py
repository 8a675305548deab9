"""Tasks the circuit tests build from random token ids."""

import torch

import contribution_lens as cl


def random_task(model, n: int = 3, length: int = 7, seed: int = 0) -> cl.Task:
    """Random clean and corrupted ids of one length; the last prompt right-padded by two positions.

    Ids start at 1: 0 is the pad of the tiny checkpoints' tokenizer, which a prompt does not hold where it is read.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = min(int(model.cfg.d_vocab), 50)
    clean = torch.randint(1, vocab, (n, length), generator=generator)
    corrupted = torch.randint(1, vocab, (n, length), generator=generator)
    last = cl.Task.full_length(clean)
    last[-1] = length - 3
    answer = torch.arange(n) % vocab
    return cl.Task("random", clean, corrupted, answer, (answer + 1) % vocab, last)

"""A user's training script on the worker library: a small tied-embedding language model, SGD with
momentum and a StepLR schedule, random-token data. Nothing in it knows about plans, pipelines or
failures; the library owns those (docs/worker-api.md).

    python examples/sgd_tied.py --redis-url redis://127.0.0.1:6380/0 --job J --worker-id w0
    CHAMELEON_REDIS_URL=... CHAMELEON_JOB=J torchrun --nproc-per-node 2 examples/sgd_tied.py

The job's spec must have 6 layers and [training] global_batch 12, micro_batch 2. Set
SGD_TIED_MALFORMED=shape to start it with a layer whose output shape changes between calls, or
SGD_TIED_MALFORMED=state with an optimizer that keeps an object of its own in its state, which no
migration can load (the worker refuses either, exit 8). `chameleon-worker --script
examples/sgd_tied.py ...` trains it too.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from chameleond.worker import Job, Layers, Tie, Training, run

VOCAB, WIDTH, SEQ, BLOCKS = 64, 16, 8, 4


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, hidden)
        self.down = nn.Linear(hidden, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class Shifty(nn.Module):
    """Malformed: every call returns one more position than the last."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(torch.cat([x] + [x[:, :1]] * self.calls, dim=1))


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample i: SEQ + 1 random tokens from a generator seeded with i (a repeating pattern, so
    there is something to learn)."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids = (start + torch.arange(SEQ + 1) * (1 + i % 3)) % VOCAB
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(
        logits.transpose(1, 2), batch["labels"], reduction="none"
    )
    return per_token.mean(dim=1)  # one loss per sample


def sgd(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(named, lr=0.1, momentum=0.9)


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)


class Visits:
    """A user object in an optimizer's state (SGD_TIED_MALFORMED=state)."""

    def __init__(self, count: int) -> None:
        self.count = count


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps in a `Visits` kept in each parameter's state."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["visits"] = Visits(self.state[p].get("visits", Visits(0)).count + 1)
        return loss


def build(malformed: str = "") -> Training:
    torch.manual_seed(0)  # every worker builds the same initial weights
    embed = nn.Embedding(VOCAB, WIDTH)
    nn.init.normal_(embed.weight, std=0.1)
    blocks: list[nn.Module] = [Block(hidden=8 * (i + 1)) for i in range(BLOCKS)]
    if malformed == "shape":
        blocks[1] = Shifty()
    head = Head()
    head.out.weight = embed.weight  # tied, as GPT-2's wte and lm_head
    return Training(
        model=Layers([embed, *blocks, head], ties=[Tie((0, "weight"), (BLOCKS + 1, "out.weight"))]),
        loss=loss,
        dataset=Tokens(),
        optimizer=(lambda ps: CountingSGD(ps, lr=0.1)) if malformed == "state" else sgd,
        scheduler=step_lr,
        global_batch=12,
        micro_batch=2,
    )


def training(job: Job) -> Training:
    """What `run` (and `chameleon-worker --script`) trains, once the job's spec is known."""
    return build(os.environ.get("SGD_TIED_MALFORMED", ""))


if __name__ == "__main__":
    sys.exit(run(training))

"""The reading order in ``shardwise/engine/__init__.py`` names exactly the engine files one training step
enters: a step is traced (``sys.setprofile``) on two ranks and every engine file a Python call lands in is
compared with the list, and with the count the docstring states."""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.nn as nn

import shardwise
import shardwise.engine
from harness import run_distributed

ENGINE = os.path.dirname(shardwise.engine.__file__)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)) + x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.bn = nn.BatchNorm1d(8)  # a buffer: the step broadcasts rank 0's
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(self.bn(h))


def _files_a_step_enters(rank, world_size):
    torch.manual_seed(0)
    model = shardwise.shard(_Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 4)

    def step():
        model(x).pow(2).mean().backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()

    step()  # the first step also records the forward order and builds the optimizer state
    entered = set()

    def note(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ENGINE):
            entered.add(os.path.relpath(frame.f_code.co_filename, ENGINE))

    sys.setprofile(note)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(entered)


def _reading_order() -> tuple[int, list[str]]:
    doc = shardwise.engine.__doc__
    count = int(re.search(r"The step enters these (\d+) files", doc).group(1))
    listed = re.findall(r"^\s*\d+\.\s+``([\w/]+\.py)``", doc, flags=re.M)
    return count, listed


def test_the_reading_order_names_every_file_a_step_enters():
    entered = run_distributed(_files_a_step_enters, 2, env={"SHARDWISE_CHECK_COLLECTIVES": "1"})[0]
    count, listed = _reading_order()
    assert len(listed) == len(set(listed)) == count, f"the docstring says {count} files and lists {listed}"
    assert sorted(listed) == entered, (f"entered but not listed: {sorted(set(entered) - set(listed))}; "
                                       f"listed but not entered: {sorted(set(listed) - set(entered))}")

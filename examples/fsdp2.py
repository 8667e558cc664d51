"""Plain PyTorch blocks + FSDP2 (fully_shard) over a single-process gloo group, world size 1 (CPU).

    python examples/fsdp2.py --k 2
    python examples/fsdp2.py --url http://127.0.0.1:8000

Question: which blocks must I checkpoint to fit, and does the plan survive FSDP2 sharding?
Order matters: memfit.apply (checkpoint_wrapper on the chosen blocks) *before* fully_shard.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from _common import (
    parser,
    peak_meter,
    plan_source,
    predicted_peak,
    print_measured_vs_predicted,
    print_plan,
    setup_logging,
)
from torch import nn

import memfit
from memfit.api import ArchitectureIn

D, HEADS, FFN, VOCAB, LAYERS, SEQ = 64, 4, 256, 512, 6, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.up, self.down = nn.Linear(D, FFN), nn.Linear(FFN, D)

    def forward(self, x):
        h = self.norm1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        """Next-token cross-entropy loss of ``ids`` (a scalar: FSDP2's root module then returns a fresh
        tensor, not a view of the logits, which its pre-backward hook would warn about)."""
        h = self.embed(ids[:, :-1])
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    setup_logging(args.verbose)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = TinyLM()
        arch = ArchitectureIn(
            num_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS, intermediate_size=FFN, vocab_size=VOCAB
        )  # a plain model has no HF config: say what it is

        def request(cap):
            return memfit.describe(model, micro_batch_size=4, seq_len=SEQ, architecture=arch, gpu_memory_bytes=cap)

        rec = plan_source(args, request, LAYERS)
        plan = memfit.apply(model, rec, layers=model.blocks)  # 1) checkpoint the chosen blocks
        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:  # 2) then shard
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, VOCAB, (4, SEQ + 1))
        verified = False
        with peak_meter(model) as meter:
            for step in range(args.steps):
                loss = model(ids)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    verified = memfit.verify(plan)
                print(f"step {step}: loss {loss.item():.4f}")
        print_plan(plan, verified)
        print_measured_vs_predicted(meter, predicted_peak(rec, request, plan.k), plan.k)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

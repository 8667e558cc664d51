"""A Megatron-DeepSpeed style model that calls deepspeed.checkpointing.checkpoint for every layer.

memfit patches that function so only the chosen layers recompute. Without deepspeed installed the
example uses memfit's stand-in (same call convention: ``checkpoint(function, *args)``).

Question: which of my 6 layers must recompute so seq 32 x batch 4 fits, in a model that calls
DeepSpeed's checkpoint for every layer?

    python examples/deepspeed_style.py --k 3
    python examples/deepspeed_style.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import (
    cpu_frameworks,
    parser,
    peak_meter,
    plan_source,
    predicted_peak,
    print_measured_vs_predicted,
    print_plan,
    setup_logging,
)
from torch import nn

cpu_frameworks()

import memfit
from memfit.api import ArchitectureIn
from memfit.integrations.deepspeed import (
    checkpointing_module,
    deepspeed_activation_checkpointing_config,
    patch_deepspeed_checkpointing,
    standin_checkpointing,
)

D, HEADS, FFN, VOCAB, LAYERS, SEQ = 64, 4, 256, 512, 6, 32

try:
    ds_checkpointing = checkpointing_module()  # the real deepspeed.checkpointing
    print("using deepspeed.checkpointing")
except ImportError:
    ds_checkpointing = standin_checkpointing()
    print("deepspeed not installed: using memfit's stand-in for deepspeed.checkpointing")


class ParallelTransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FFN), nn.Linear(FFN, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, D))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class GPTModel(nn.Module):
    """Megatron's transformer: ``checkpoint(custom_forward, hidden)`` for every layer when recomputing."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(ParallelTransformerLayer() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:

            def custom_forward(x, layer=layer):
                return layer(x)

            h = ds_checkpointing.checkpoint(custom_forward, h)  # looked up at call time: patchable
        return self.head(h)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    setup_logging(args.verbose)
    torch.manual_seed(0)
    model = GPTModel()
    arch = ArchitectureIn(
        num_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS, intermediate_size=FFN, vocab_size=VOCAB
    )

    def request(cap):
        return memfit.describe(model, micro_batch_size=4, seq_len=SEQ, architecture=arch, gpu_memory_bytes=cap)

    rec = plan_source(args, request, LAYERS)
    print("DeepSpeed JSON block:", deepspeed_activation_checkpointing_config(rec, num_layers=LAYERS))
    patch = patch_deepspeed_checkpointing(rec, num_layers=LAYERS, module=ds_checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (4, SEQ + 1))
    verified = False
    with peak_meter(model) as meter:
        for step in range(args.steps):
            patch.reset()  # one forward = LAYERS calls, in order
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                verified = memfit.verify(patch.plan)
            print(f"step {step}: loss {loss.item():.4f}")
    patch.undo()
    print_plan(patch.plan, verified)
    print_measured_vs_predicted(meter, predicted_peak(rec, request, patch.plan.k), patch.plan.k)


if __name__ == "__main__":
    main()

"""Measure your own training loop with capture's Recorder and sign the result into a manifest.

    python examples/recorder_example.py [OUTPUT.toml]

A small GPT-2 (built from its config, no download) trains on random tokens from a standard
PyTorch DataLoader; the Recorder times every step (CUDA events on a GPU, the wall clock on a
CPU), the time spent waiting for the loader, and memory, exactly as `capture trial` does. The
manifest is signed with your default key (~/.config/capture/id_ed25519, created on first use).
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from capture import Recorder


def main(argv: list[str]) -> int:
    output = argv[0] if argv else "recorder-example.toml"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0)).to(device)
    model.loss_type = "ForCausalLM"  # GPT-2 names no loss type; transformers 5 warns unless one is set
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (256, 64))
    loader = DataLoader(TensorDataset(tokens), batch_size=8, shuffle=True)

    with Recorder(device, warmup_steps=2, model=model, precision="fp32") as rec:
        for (ids,) in rec.batches(loader):
            ids = ids.to(device, non_blocking=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rec.step(tokens=ids.numel(), loss=loss)  # no .item(): the loss is read after the loop
            if rec.measured_steps == 10:
                break

    s = rec.result.stats
    print(f"{s.steps} measured steps: median {s.step_time_median_s * 1e3:.1f} ms, p90 {s.step_time_p90_s * 1e3:.1f} ms, "
          f"CV {s.step_time_cv:.3f}, stall share {s.stall_share:.1%}, {s.tokens_per_s:,.0f} tokens/s")
    print(f"device memory {rec.result.memory.device_used_bytes / 2**20:.0f} MiB ({rec.result.memory.device_used_source})")
    print(rec.write_manifest(output))  # and the HTML report beside it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A Lightning fit recorded by capture's callback (a tiny GPT-2 built from its config; CPU).

    python examples/lightning_example.py [OUT.toml [WORKDIR]]
    torchrun --nproc-per-node 2 examples/lightning_example.py run.toml work    # DDP: rank 0 writes one manifest

Writes OUT.toml (signed with your default key) and OUT.html. Needs `pip install 'capture-stack[lightning]'`.
"""

import os
import sys
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2() -> GPT2LMHeadModel:
    """A 2-layer GPT-2 built from its config: nothing is downloaded."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # GPT-2 names no loss type; transformers 5 warns unless one is set
    return model


def main(argv: list[str], trackers: tuple = ()) -> object:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from capture.integrations.lightning import CaptureCallback

    warnings.filterwarnings("ignore", module="lightning")  # "no workers in the DataLoader" and friends

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def validation_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    out = argv[0] if argv else "lightning-example.toml"
    workdir = argv[1] if len(argv) > 1 else "lightning-example-work"
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (64, 16), generator=torch.Generator().manual_seed(0))
    train = torch.utils.data.DataLoader(ids, batch_size=2)
    val = torch.utils.data.DataLoader(ids[:4], batch_size=2)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    callback = CaptureCallback(out, warmup_steps=1, trackers=trackers)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=6,
                        accumulate_grad_batches=2, val_check_interval=6, limit_val_batches=2, num_sanity_val_steps=0,
                        callbacks=[callback, ModelCheckpoint(dirpath=workdir, every_n_train_steps=3, save_top_k=-1)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=workdir)
    trainer.fit(LM(), train, val)
    print("manifest:", callback.manifest_path)
    return callback


if __name__ == "__main__":
    main(sys.argv[1:])
    # Under torchrun: take the process group down before the interpreter does, as PyTorch asks,
    # so that pending collectives finish first (NCCL warns at exit otherwise). The framework's
    # process group outlives fit/train.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
